"""The TOKENSPEED attention backend: backend class, metadata builder, impl.

Kept import-light: vLLM resolves ``backend.TokenspeedAttentionBackend`` by its path, and the
backend imports the builder and impl only when vLLM asks for them.
"""
