"""Adapters to other libraries' models. Each module imports its library when it is imported itself, never here:
``distcomm_attention.integrations.huggingface`` needs ``transformers`` (``pip install 'distcomm[hf]'``)."""

__all__: list[str] = []
