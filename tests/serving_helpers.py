"""What the serving tests share: a letters tokenizer for the scheduler tests, and a server started in a thread of
the test process on a free loopback port."""
import socket
import threading
import time

import httpx

MASK, PAD, EOS, BOS = 60, 59, 58, 57


class Tok:
    """What the scheduler and a job ask of a tokenizer (ids decode to letters)."""
    mask, pad, eos, bos = MASK, PAD, EOS, BOS

    def decode(self, ids):
        return "".join(chr(65 + int(i) % 26) for i in ids)

    def token(self, i):
        return chr(65 + int(i) % 26)


def wait_done(jobs, timeout: float = 60) -> None:
    """Until every job is done (a scheduler's jobs), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not all(j.done for j in jobs):
        assert time.monotonic() < deadline, "the scheduler got stuck"
        time.sleep(0.005)


def serve_in_thread(srv, serve, join_timeout: float = 60) -> tuple:
    """``serve(srv, sock)`` on a free loopback port in a thread, once /health answers 200: (url, stop(), thread)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    box = {}
    t = threading.Thread(target=serve, args=(srv, sock), kwargs={"announce": lambda w: box.update(web=w)},
                         daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not answer /health"
        time.sleep(0.05)

    def stop():
        box["web"].should_exit = True
        t.join(timeout=join_timeout)
        assert not t.is_alive()
    return url, stop, t
