"""The multi-host fault lab: hosts as network namespaces on a bridge (tests.faultlab.net), a
gcache cluster spread over them with a client driver (tests.faultlab.lab), and a TCP delay proxy
for latency (tests.faultlab.proxy). The ``netlab`` fixture (tests/conftest.py) builds one per
test and removes it afterwards; without root the tests that use it are skipped."""

from tests.faultlab.lab import Lab, LabConfig
from tests.faultlab.net import LabUnavailable, Net, unavailable_reason

__all__ = ["Lab", "LabConfig", "LabUnavailable", "Net", "unavailable_reason"]
