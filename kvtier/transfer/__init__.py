"""Data plane: moves bytes between device tensors, CPU-region rows and files.

* :mod:`kvtier.transfer.device`: copies between the serving engine's KV tensors and
  CPU-region rows (CUDA streams and events, or CPU threads without a GPU);
* :mod:`kvtier.transfer.io_engine`: vectored file I/O behind one interface, io_uring
  (:mod:`kvtier.transfer.uring`) or a thread pool (:mod:`kvtier.transfer.threads`),
  what the file tier reads and writes its slots with;
* :mod:`kvtier.transfer.completion`: the handle every tier and copy returns for work
  handed to hardware or a thread.

Only the CPU region ever touches the device; the tiers below it (host, file,
cluster) move their bytes from and into its rows. Nothing here decides
residency: the chain and the managers decide, then drive these.
"""
