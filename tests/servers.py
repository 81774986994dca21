"""The suite's name for `devstack.servers`: private servers, scratch databases, processes."""

from devstack.servers import *  # noqa: F403
from devstack.servers import __all__ as __all__
