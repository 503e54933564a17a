"""URL passwords never printed."""

import pytest

from tandem.redaction import redacted


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://:S3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        (
            "at rediss://default:p%40ss@h:1 (--redis-url)",
            "at rediss://default:***@h:1 (--redis-url)",
        ),
        ("redis://redis:6379/0", "redis://redis:6379/0"),  # no password: as it is
        ("redis://:p@ss@host:6379/0", "redis://:***@host:6379/0"),  # an @ in it, unquoted
        ("unix://:pw@/run/redis.sock", "unix://:***@/run/redis.sock"),
        ("two: redis://:a@x and redis://u:b@y", "two: redis://:***@x and redis://u:***@y"),
    ],
)
def test_a_urls_password_is_starred(text, shown):
    assert redacted(text) == shown
