#!/usr/bin/env python3
"""One TCP stream between two netbed hosts, timed: checks the links' shaping.

    throughput.py serve PORT            (prints the bytes received and the rate, one JSON line)
    throughput.py send ADDR PORT BYTES  (sends BYTES of zeros)

The receiver times from its first byte to the last, so connection setup is
not counted.
"""
import json
import socket
import sys
import time


def serve(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(1)
    c, _ = s.accept()
    n, t0, buf = 0, None, bytearray(1 << 20)
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        if t0 is None:
            t0 = time.perf_counter()
        n += k
    dt = time.perf_counter() - t0
    print(json.dumps({"bytes": n, "seconds": dt, "bits_per_second": n * 8 / dt}), flush=True)


def send(addr, port, nbytes):
    for _ in range(200):  # the server may still be starting
        try:
            c = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit(f"throughput.py: cannot connect to {addr}:{port}")
    chunk = bytes(1 << 20)
    left = nbytes
    while left > 0:
        c.sendall(chunk[:min(left, len(chunk))])
        left -= len(chunk)
    c.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)
