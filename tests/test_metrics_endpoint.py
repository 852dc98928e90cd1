"""The /metrics HTTP endpoint answers on /metrics only, and keeps asking for the token where the server does."""

from __future__ import annotations

import urllib.error
import urllib.request

from fake_engine import serve_fake


def status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        err.close()
        return err.code


def test_paths_other_than_metrics_are_not_found():
    with serve_fake(metrics_port=0) as server:
        base = f"http://127.0.0.1:{server.metrics_port}"
        assert status(base + "/metrics") == 200
        for path in ("/", "/favicon.ico", "/metrics/", "/metricsx", "/admin"):
            assert status(base + path) == 404, path


def test_with_a_token_every_path_needs_it_first(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret")
    with serve_fake(metrics_port=0, auth_token_file=token) as server:
        base = f"http://127.0.0.1:{server.metrics_port}"
        assert (status(base + "/metrics"), status(base + "/other")) == (401, 401)
        assert (status(base + "/metrics", "s3cret"), status(base + "/other", "s3cret")) == (200, 404)
