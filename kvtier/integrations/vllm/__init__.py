"""kvtier as vLLM's KV offloading backend (``pip install kvtier[vllm]``).

vLLM loads it through its ``OffloadingConnector``::

    kv_connector_extra_config = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "cpu_bytes_to_use": "4GiB",
        "file_tier": {"root": "/var/cache/kvtier", "bytes_to_use": "200GiB"},
    }

:mod:`kvtier.integrations.vllm.spec` imports vLLM; this package itself does
not, so :mod:`kvtier.integrations.vllm.settings` (the configuration) is usable
without it. See docs/vllm.md.
"""
