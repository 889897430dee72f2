"""Data plane: moves bytes between device tensors, the CPU region and files.

Nothing here decides residency; the engine asks the managers, then drives these.
"""
