"""Run the real kvtierd with the FAKE CUDA backend of :mod:`tests.fake_cuda` installed.

``python -m tests.fake_cuda_kvtierd <kvtierd flags>``, with ``FAKE_CUDA_DIR`` naming
the fake's directory. Everything but the CUDA calls is the daemon's own ``main``.
"""

from __future__ import annotations

import os
import sys

from kvtier.daemon.__main__ import main
from kvtier.daemon.transfer.cuda.backend import install_backend
from tests.fake_cuda import FakeCuda

if __name__ == "__main__":
    install_backend(FakeCuda(os.environ["FAKE_CUDA_DIR"]))
    sys.exit(main())
