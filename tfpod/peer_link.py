"""Copies of folders between the hosts of a job, over TCP: what in-memory checkpoints
(tfpod.memory_checkpoint) send to a peer host and fetch back from it.

Every host of a multi-host job serves one TCP port (picked free at start) on all its
interfaces and publishes `address:port:token` in TensorFlow's coordination service (the
key-value store every DTensor client of the job shares), the address being the one its
DTensor job entry names ($DTENSOR_JOBS, which the other hosts already reach). A request
carries the serving host's token (random, known only through the job's own store), so
no other process can write into or read from a host's memory.

    PUT <token> <from host> <step>\\n<tar stream>   keep this folder as <from host>'s copy of <step>
    GET <token> <host> <step>\\n                    -> OK\\n<tar stream> | NO\\n

What a host keeps and where is its store's business (`Store`: `put` and `get` of a
(host, step) folder); this module only moves folders.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import socketserver
import tarfile
import threading
from typing import Protocol

log = logging.getLogger("tfpod")

KEY = "tfpod/peer_link/{instance}/{host}"
TIMEOUT_S = 600.0  # a transfer that stalls this long fails (the snapshot is then not at the peer)


class Store(Protocol):
    def incoming(self, host: int, step: int) -> str: ...  # an empty folder to unpack a copy into
    def received(self, host: int, step: int, folder: str) -> None: ...  # the copy is whole: keep it
    def copy_of(self, host: int, step: int) -> str | None: ...  # the folder of a copy held, or None


class PeerLink:
    """This host's server of copies and its client of the other hosts' (see the module docstring).

    Args:
      host, hosts: this host's index and the number of hosts.
      store: where received copies go and held copies come from.
      kv: the coordination service's context (tensorflow.python.eager.context.context()).
      instance: which of the process's links this is (made in the same order on every host).
    """

    def __init__(self, host: int, hosts: int, store: Store, kv, instance: int = 0):
        self.host, self.hosts, self.store, self._kv, self._instance = host, hosts, store, kv, instance
        self._token = secrets.token_hex(16)
        self._peers: dict[int, tuple[str, int, str]] = {}
        link = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                self.request.settimeout(TIMEOUT_S)
                link._serve(self.rfile, self.wfile)

        self._server = socketserver.ThreadingTCPServer(("", 0), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="tfpod-peer-link", daemon=True).start()
        kv.set_config_key_value(KEY.format(instance=instance, host=host), f"{own_address(host)}:{port}:{self._token}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _peer(self, host: int) -> tuple[str, int, str]:
        if host not in self._peers:
            value = self._kv.get_config_key_value(KEY.format(instance=self._instance, host=host), int(TIMEOUT_S * 1000))
            address, port, token = value.rsplit(":", 2)
            self._peers[host] = (address, int(port), token)
        return self._peers[host]

    def _connect(self, host: int) -> tuple[socket.socket, str]:
        address, port, token = self._peer(host)
        sock = socket.create_connection((address, port), timeout=TIMEOUT_S)
        return sock, token

    def send(self, to_host: int, step: int, folder: str) -> None:
        """Sends `folder` (this host's snapshot of `step`) to `to_host`, which keeps it as this host's copy.

        Raises:
          OSError: the peer could not be reached or did not confirm the copy.
        """
        sock, token = self._connect(to_host)
        with sock, sock.makefile("wb") as out, sock.makefile("rb") as answer:
            out.write(f"PUT {token} {self.host} {step}\n".encode())
            with tarfile.open(fileobj=out, mode="w|") as tar:
                tar.add(folder, arcname=".")
            out.flush()
            sock.shutdown(socket.SHUT_WR)
            reply = answer.readline().decode().strip()
        if reply != "OK":
            raise OSError(f"host {to_host} did not keep the copy ({reply or 'no answer'})")

    def fetch(self, from_host: int, host: int, step: int, folder: str) -> bool:
        """Fetches `host`'s copy of `step` that `from_host` holds into `folder` (created); False when it holds none."""
        sock, token = self._connect(from_host)
        with sock, sock.makefile("wb") as out, sock.makefile("rb") as answer:
            out.write(f"GET {token} {host} {step}\n".encode())
            out.flush()
            reply = answer.readline().decode().strip()
            if reply != "OK":
                return False
            os.makedirs(folder, exist_ok=True)
            with tarfile.open(fileobj=answer, mode="r|") as tar:
                tar.extractall(folder, filter="data")
        return True

    def _serve(self, rfile, wfile) -> None:
        words = rfile.readline().decode().split()
        if len(words) != 4 or words[1] != self._token or words[0] not in ("PUT", "GET"):
            wfile.write(b"NO bad request\n")
            return
        verb, _, host, step = words[0], words[1], int(words[2]), int(words[3])
        if verb == "GET":
            folder = self.store.copy_of(host, step)
            if folder is None:
                wfile.write(b"NO\n")
                return
            wfile.write(b"OK\n")
            with tarfile.open(fileobj=wfile, mode="w|") as tar:
                tar.add(folder, arcname=".")
            return
        folder = self.store.incoming(host, step)
        try:
            with tarfile.open(fileobj=rfile, mode="r|") as tar:
                tar.extractall(folder, filter="data")
            self.store.received(host, step, folder)
        except (OSError, tarfile.TarError) as e:
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("host %d's copy of its step %d snapshot could not be kept here: %s", host, step, e)
            wfile.write(f"NO {e}\n".encode())
            return
        wfile.write(b"OK\n")


def own_address(host: int) -> str:
    """The address the other hosts reach this host at: its entry in $DTENSOR_JOBS, else its name."""
    jobs = [j for j in os.environ.get("DTENSOR_JOBS", "").split(",") if j]
    if host < len(jobs):
        return jobs[host].rsplit(":", 1)[0]
    return socket.gethostname()
