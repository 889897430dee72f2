"""kvtier as vLLM's KV offloading backend (the ``vllm`` extra; see docs/vllm.md).

vLLM loads it through its ``OffloadingConnector``::

    kv_connector_extra_config = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "cpu_bytes_to_use": "4GiB",
        "file_tier": {"root": "/var/cache/kvtier", "bytes_to_use": "200GiB"},
    }

:mod:`.spec` (the spec vLLM loads), :mod:`.manager` (its scheduler side),
:mod:`.worker` (its worker side), :mod:`._common` and :mod:`.serve` (vLLM's
command line on its CPU build) import vLLM; this package itself does not, nor
do :mod:`.settings` (the configuration), :mod:`.identity` (the model's
fingerprint), :mod:`.encoding` (what the bytes mean) and :mod:`.statistics`
(the front's own statistics record and its metrics), which are usable
without it. See docs/vllm.md.
"""
