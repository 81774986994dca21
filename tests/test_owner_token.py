"""Owner tokens: 128 bits of hex, unique per grant, and never repeated by a forked child."""

from __future__ import annotations

import os

from jobfence.locks.lease import new_owner_token


def test_tokens_are_128_bits_of_hex_and_unique() -> None:
    tokens = {new_owner_token() for _ in range(100_000)}
    assert len(tokens) == 100_000
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in list(tokens)[:100])


def test_a_forked_child_draws_tokens_of_its_own() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next tokens, to the parent
        os.close(read)
        os.write(write, "".join(new_owner_token() for _ in range(50)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    child = {text[i:i + 32] for i in range(0, len(text), 32)}
    parent = {new_owner_token() for _ in range(50)}
    assert len(child) == 50 and not child & parent  # same counter values, another key
