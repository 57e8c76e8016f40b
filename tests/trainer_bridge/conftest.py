"""Ray's clusters in these tests (``ray.init`` and ``ray start``) run without Ray's own token authentication: it
is read once per process, so a test that switched it would break the clusters of the tests after it."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
