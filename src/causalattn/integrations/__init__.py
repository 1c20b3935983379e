"""Bridges to other libraries (optional extras): :mod:`.transformers` for Hugging Face."""
