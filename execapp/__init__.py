"""execapp: adaptive task execution for Django (engine in ``execapp.engine``)."""
