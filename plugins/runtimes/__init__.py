"""The sandboxes, Django-free: the runtime registry (``registry.py``: which runtimes exist and how
to compile for each), the interface every runtime implements (``base.py``), the host API guests
call (``host.py``, with the KV store injected through ``kvstore.py`` and its bounded HTTP transport
in ``deadline_net.py``) and one module per runtime: Lua (``lua.py``, lupa), WASM (``wasm.py``,
wasmtime), JS (``js.py``, QuickJS).

This package imports nothing: ``plugins.spec`` reads the registry, and the runtime modules
import the spec, so loading a submodule must not pull the others in.
"""
