"""The entrypoint tests' tiny chat model and live server, shared with the benchmark tests.

pytest loads conftest files only from a test's own folder and its parents, so the
fixtures are imported here rather than moved.
"""

from tests.entrypoints.conftest import chat_model_path, server

__all__ = ["chat_model_path", "server"]
