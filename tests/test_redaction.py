"""URL passwords never printed."""

import pytest

from tandem.redaction import check_redis_url, redacted


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
        # A base64 password holds a /; others a ? or #, unencoded.
        ("redis://:Xk9f/p7Lr@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("at redis://:a?b#c@h/0 (x)", "at redis://:***@h/0 (x)"),
        # The password as a query parameter, which redis-py reads too.
        (
            "redis://h:1/0?password=TopSecret (--redis-url)",
            "redis://h:1/0?password=*** (--redis-url)",
        ),
        ("unix:///r.sock?db=1&Password=pw&x=1", "unix:///r.sock?db=1&Password=***&x=1"),
        # A TLS key's passphrase, which redis-py reads as ssl_password.
        ("rediss://h/0?ssl_password=KeyPass&a=1", "rediss://h/0?ssl_password=***&a=1"),
        # A password where the user goes (no colon): neither is shown.
        ("at redis://Sup3rPw@127.0.0.1:6379/0 (x)", "at redis://***@127.0.0.1:6379/0 (x)"),
    ],
)
def test_a_urls_password_is_starred(text, shown):
    assert redacted(text) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://:Xk9f/p7Lr@127.0.0.1:6379/0",
        "redis://:a?b@h:1/0",
        "hunter2",
        "redis://h:x/0",
        # Digits then a ? or # in the password read as a port: the client dialled
        # localhost:2024, and its error quoted the password's first half as the port.
        "redis://:2024?Winter@redis:6379/0",
        "redis://alice:9911#x@h/0",
        "redis:///0",  # no host
    ],
)
def test_a_url_redis_cannot_read_is_refused_without_a_piece_of_it(url):
    # redis-py's reason quotes a piece ("cannot be cast to integer value as 'Xk9f'").
    with pytest.raises(ValueError) as refused:
        check_redis_url(url, "--redis-url")
    message = str(refused.value)
    assert message.startswith("--redis-url is not a Redis URL: redis://[[user]:password@]")
    assert "percent-encode" in message
    for piece in ("Xk9f", "p7Lr", "hunter2", "'a'", "'x'", "2024", "9911", "Winter"):
        assert piece not in message


def test_a_url_redis_reads_passes():
    for url in (
        "redis://:p%2Fq@h:6379/0",
        "rediss://u:pw@h/3?ssl_ca_certs=/etc/ca.pem",
        "unix:///run/redis.sock",
        "unix://alice:pw@/run/redis.sock?db=4",
        "redis://h/0?socket_timeout=5",
        "redis://h/0?max_connections=50",  # the pool's
    ):
        check_redis_url(url, "--redis-url")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://:pw@h:6379/0?ssl=true", "the connection option ssl (a query parameter of"),
        ("redis://h/0?pasword=typo", "takes the connection option pasword"),
        # The engines' (sync) client takes it, the gateway's (asyncio) one does not.
        ("rediss://h/0?ssl_validate_ocsp=true", "the connection option ssl_validate_ocsp"),
    ],
)
def test_a_query_parameter_redis_does_not_know_is_named(url, says):
    # Passed through to the connection: every connection failed with a TypeError (the
    # engine's traceback, the gateway's 500s), long after the URL was taken.
    with pytest.raises(ValueError) as refused:
        check_redis_url(url, "--redis-url")
    assert says in str(refused.value) and "typo" not in str(refused.value)
