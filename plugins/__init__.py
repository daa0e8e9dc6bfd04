"""plugins: the plugin registry, the sandboxed runtimes and the bundled examples."""
