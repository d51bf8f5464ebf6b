"""Structured outputs: params.py (what a request asks for; a leaf), manager.py (grammars, matchers and bitmasks
in the engine core). Kept import-free here so that sampling_params can import params.py."""
