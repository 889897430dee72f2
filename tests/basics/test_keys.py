from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvtier import KEY_BYTES, InvalidArgumentError, chain_keys

NS = b"\x01" * 16

# Golden values: keys must never change across releases, processes or machines,
# or every file tier written by an older kvtier silently stops hitting.
GOLDEN = [
    "b4c3b427a3979b9825b11d6d28cd16e7",
    "d9487ee4233067050a6abec210da643d",
]


def test_golden_values() -> None:
    keys = chain_keys(list(range(10)), 4, NS)
    assert [k.hex() for k in keys] == GOLDEN


def test_same_in_another_process() -> None:
    code = (
        "from kvtier import chain_keys; print(chain_keys(list(range(10)), 4, b'\\x01'*16)[1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.strip() == GOLDEN[1]


def test_one_key_per_full_block() -> None:
    assert len(chain_keys(range(15), 4, NS)) == 3
    assert len(chain_keys(range(16), 4, NS)) == 4
    assert chain_keys([], 4, NS) == []
    assert chain_keys(range(3), 4, NS) == []
    assert all(len(k) == KEY_BYTES for k in chain_keys(range(64), 16, NS))


def test_prefix_property() -> None:
    a = chain_keys(list(range(40)), 8, NS)
    b = chain_keys([*range(24), 999, *range(25, 40)], 8, NS)
    assert a[:3] == b[:3]
    assert a[3] != b[3]
    # the change poisons every later block too: a key names the whole prefix
    assert a[4] != b[4]


def test_namespace_separates() -> None:
    assert not set(chain_keys(range(32), 8, NS)) & set(chain_keys(range(32), 8, b"\x02" * 16))


def test_parent_continues_chain() -> None:
    whole = chain_keys(range(32), 8, NS)
    tail = chain_keys(range(16, 32), 8, NS, parent=whole[1])
    assert tail == whole[2:]


def test_numpy_and_list_agree() -> None:
    tokens = np.arange(100, 164, dtype=np.int32)
    assert chain_keys(tokens, 16, NS) == chain_keys(tokens.tolist(), 16, NS)
    assert chain_keys(tokens.astype(np.uint64), 16, NS) == chain_keys(tokens.tolist(), 16, NS)


@pytest.mark.parametrize(
    ("tokens", "block", "ns", "parent", "message"),
    [
        pytest.param(range(8), 0, NS, None, "block_tokens", id="block-zero"),
        pytest.param(range(8), True, NS, None, "block_tokens", id="block-bool"),
        pytest.param(range(8), 4, b"", None, "namespace", id="ns-empty"),
        pytest.param(range(8), 4, "ns", None, "namespace", id="ns-str"),
        pytest.param(range(8), 4, NS, b"short", "parent", id="parent-len"),
        pytest.param([1.5, 2.0], 1, NS, None, "integers", id="floats"),
        pytest.param([-1, 2], 1, NS, None, "non-negative", id="negative"),
        pytest.param([[1, 2]], 1, NS, None, "flat", id="nested"),
    ],
)
def test_bad_inputs(
    tokens: object, block: object, ns: object, parent: object, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        chain_keys(tokens, block, ns, parent)  # type: ignore[arg-type]
