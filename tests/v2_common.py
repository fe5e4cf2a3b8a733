"""What tests/v2_clients.py (tritonclient) and tests/v2_kserve_client.py (kserve) both
check against: the alpha POST /invocations answers for a photo, and an alpha within 1 LSB
of it."""

import io
import urllib.request

import numpy as np
from PIL import Image


def invocations_alpha(base_url, photo, content_type="image/jpeg"):
    """The alpha `celer serve` at `base_url` (http://host:port) answers on /invocations."""
    request = urllib.request.Request(
        f"{base_url}/invocations",
        data=photo,
        headers={
            "Content-Type": content_type,
            "X-Amzn-SageMaker-Custom-Attributes": "output=alpha",
        },
    )
    with urllib.request.urlopen(request) as response:
        return np.asarray(Image.open(io.BytesIO(response.read())).convert("L"))


def close_to(what, alpha, expected):
    assert alpha.dtype == np.uint8, f"{what}: {alpha.dtype}"
    assert alpha.shape == expected.shape, f"{what}: shape {alpha.shape} vs {expected.shape}"
    worst = int(np.abs(alpha.astype(int) - expected.astype(int)).max())
    assert worst <= 1, f"{what}: alpha differs from /invocations' by {worst}"
    print(f"{what}: alpha {alpha.shape} within {worst} LSB of /invocations")
