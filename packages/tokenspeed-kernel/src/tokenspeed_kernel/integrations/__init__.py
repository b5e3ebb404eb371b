"""Optional integrations with other libraries.

Nothing here is imported by ``import tokenspeed_kernel``: each integration is a submodule
that imports its library only when it is itself imported (``import
tokenspeed_kernel.integrations.transformers``), so the core keeps torch as its only
dependency.
"""
