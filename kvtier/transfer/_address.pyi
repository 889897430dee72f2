"""Types of the compiled helper ``_address.c`` (see io_engine.buffer_address, _ring)."""

def address(buffer: object, /) -> int: ...
def check_rw(
    requests: list[list[memoryview]], offsets: list[int], alignment: int, writable: bool, /
) -> int: ...
def check_views(views: list[memoryview], nbytes: int, alignment: int, writable: bool, /) -> int: ...
def prep_rw(
    sqes: object,
    mask: int,
    tail: int,
    opcode: int,
    fd: int,
    iovecs: object,
    stride: int,
    requests: list[list[memoryview]],
    offsets: list[int],
    start: int,
    count: int,
    batch: int,
    table: bytes | None,
    acc: bytearray | None,
    /,
) -> tuple[int, int]: ...
def reap(
    cq: object,
    head_at: int,
    tail_at: int,
    mask: int,
    cqes_at: int,
    split: dict[int, bytearray] | None,
    /,
) -> list[tuple[int, list[tuple[int, int, BaseException | None]], int, int]]: ...
