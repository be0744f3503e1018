"""Integrations with other libraries; each submodule imports its library only when imported itself."""
