"""Types of the compiled copy loops ``_copy.c`` (see kvtier.transfer._copier)."""

import numpy as np

def check(table: np.ndarray, pieces: np.ndarray, spans: np.ndarray, /) -> tuple[int, int]: ...
def copy_host(
    table: np.ndarray,
    pieces: np.ndarray,
    spans: np.ndarray,
    store: bool,
    part: int,
    parts: int,
    /,
) -> int: ...
def check_index(values: np.ndarray, bound: int, unique: bool, /) -> int: ...
def plan_units(
    rows: np.ndarray,
    ids: np.ndarray,
    bpc: int,
    skip: int,
    num_blocks: int,
    kv_first: bool,
    store: bool,
    out: np.ndarray,
    /,
) -> int: ...
def cuda_load(path: str, /) -> int: ...
def cuda_status() -> dict[str, object]: ...
def cuda_copy(
    table: np.ndarray,
    pieces: np.ndarray,
    spans: np.ndarray,
    store: bool,
    stream: int,
    device: int,
    batch: bool,
    /,
) -> int: ...
