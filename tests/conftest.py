"""What every test gets: where its asyncio tasks wait, printed if it stalls
(tests/support/stalls.py)."""

import pytest
from support.stalls import tasks_before_the_timeout

_tasks_before_the_timeout = pytest.fixture(autouse=True)(tasks_before_the_timeout)
