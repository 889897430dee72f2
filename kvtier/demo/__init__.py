"""The small model and serving loop behind ``kvtier demo``.

``model`` is a Llama-shaped decoder in plain torch with a paged KV cache;
``workload`` draws multi-turn conversations over shared prompts and documents;
``serving`` serves them concurrently over an :class:`~kvtier.engine.Engine`
and checks every output against a full recompute; ``report`` turns the
measurements into the tables the command prints. Not part of the public API.
"""
