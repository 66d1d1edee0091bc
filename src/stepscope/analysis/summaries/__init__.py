"""The summary tables: portable SQL files, the shared slice base, rendering, CNTK output."""

from .tables import *  # noqa: F403
from .tables import DEFAULT_TABLES, DETAIL_TABLES, __all__  # noqa: F401
