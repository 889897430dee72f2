"""Types of the compiled gather kernel's loader ``_gather.c`` (see kvtier.transfer._cuda_copy)."""

import numpy as np

KERNEL: str

def load_nvrtc(path: str, /) -> tuple[int, int]: ...
def load_driver(path: str, /) -> int: ...
def compile(arch: int, ptx: bool = False, source: str | None = None) -> bytes: ...
def build(device: int, /) -> str: ...
def launch(table: int, count: int, stream: int, device: int, /) -> None: ...
def table(
    table: np.ndarray,
    pieces: np.ndarray,
    spans: np.ndarray,
    store: bool,
    rows: np.ndarray,
    cap: int,
    buffers: np.ndarray,
    offsets: np.ndarray,
    slice_bytes: int,
    entry: int,
    /,
) -> tuple[bytearray, bytearray]: ...
def status() -> dict[str, object]: ...
