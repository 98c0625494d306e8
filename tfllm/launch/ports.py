"""A job's ports, bound and reached the way TensorFlow's gRPC runtime does.

Each DTensor client serves TensorFlow's gRPC services (the coordination service on
client 0, the collectives' services everywhere) on its `DTENSOR_JOBS` port, bound on
every IPv4 interface (`0.0.0.0`) with `SO_REUSEADDR`, and `SO_REUSEPORT` too where the
launcher holds the port for it (`TF_GRPC_REUSE_PORT=1`). Every client connects to client
0's port, and the collectives connect clients to each other.

`port_free` is the launcher's and the doctor's check that a port can be bound;
`Listeners` opens short-lived listening sockets on a node's ports during the doctor's
run; `probe` is client 0 connecting to one of them, and says why it failed with the
likely cause.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

#: makes TensorFlow's gRPC server bind with SO_REUSEPORT (tensorflow/core/
#: distributed_runtime/rpc/grpc_server_lib.cc)
REUSE_PORT_ENV = "TF_GRPC_REUSE_PORT"
CONNECT_TIMEOUT_S = 5.0


def _grpc_socket(reuse_port: bool) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return s


def reuse_port(environ: Mapping[str, str]) -> bool:
    """Whether the runtime binds with SO_REUSEPORT (the launcher holds the port)."""
    return environ.get(REUSE_PORT_ENV) == "1"


def port_free(port: int, reuse: bool = False) -> bool:
    """Whether TensorFlow's gRPC server could bind `port` here: on every interface, with
    address reuse (connections of an ended job in TIME_WAIT leave it free), and with port
    reuse when `reuse` (TF_GRPC_REUSE_PORT=1: the launcher holds it for the worker)."""
    with _grpc_socket(reuse) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class Listeners:
    """Listening sockets on this node's job ports, bound as the runtime binds them; each
    connection is answered with `greeting` (one line naming the rank and its run), so
    client 0 knows that it reached this process and not another program or machine.

    Args:
      ports: the ports (0: a free one, picked by the kernel).
      greeting: the bytes every connection gets.
      reuse: bind with SO_REUSEPORT too (TF_GRPC_REUSE_PORT=1).

    Attributes:
      bound: requested port -> the port listened on, or None where binding failed.
    """

    def __init__(self, ports: Sequence[int], greeting: bytes, reuse: bool = False):
        self.greeting = greeting
        self.bound: Dict[int, Optional[int]] = {}
        self._sockets: List[socket.socket] = []
        self._stop = threading.Event()
        for port in ports:
            s = _grpc_socket(reuse)
            try:
                s.bind(("0.0.0.0", port))
                s.listen(64)
            except OSError:
                s.close()
                self.bound[port] = None
                continue
            s.setblocking(False)
            self._sockets.append(s)
            self.bound[port] = s.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="tfllm-doctor-listeners")
        self._thread.start()

    @property
    def listening(self) -> List[int]:
        return [p for p in self.bound.values() if p is not None]

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            for s in self._sockets:
                selector.register(s, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.1):
                    try:
                        conn, _ = key.fileobj.accept()
                    except OSError:
                        continue
                    with conn:
                        try:
                            conn.settimeout(1.0)
                            conn.sendall(self.greeting)
                        except OSError:
                            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in self._sockets:
            s.close()
        self._sockets = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def cause(error: BaseException, timeout_s: float = CONNECT_TIMEOUT_S) -> Tuple[str, str]:
    """(what happened, its likely cause) of a failed connection from client 0."""
    if isinstance(error, socket.gaierror):
        return ("the name does not resolve on client 0's host",
                "fix DNS or /etc/hosts there, or name the nodes by their addresses "
                "(a hostfile, --hosts)")
    if isinstance(error, ConnectionRefusedError):
        return ("connection refused",
                "a firewall on that node rejects the port, or the name resolves to another "
                "machine than the node (a stale /etc/hosts or DNS entry)")
    if isinstance(error, (socket.timeout, TimeoutError)):
        return (f"no answer within {timeout_s:g} s",
                "a firewall between the nodes drops the port, or the name resolves to an "
                "address on a network client 0 cannot reach (name the nodes by their "
                "addresses on the job's network: the interface NCCL_SOCKET_IFNAME names)")
    if isinstance(error, OSError) and error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return ("no route to the host",
                "the name resolves to an address on a network client 0 is not on (a "
                "wrong interface: name the nodes by their addresses on the job's network, "
                "the interface NCCL_SOCKET_IFNAME names), or a firewall rejects it")
    return (str(error) or type(error).__name__,
            "check the network between client 0 and that node")


def probe(host: str, port: int, greeting: bytes,
          timeout_s: float = CONNECT_TIMEOUT_S) -> Optional[Tuple[str, str]]:
    """Connects to host:port as client 0 would; None when the doctor's listener there
    answered with `greeting`, else (what happened, its likely cause)."""
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:  # socket.timeout and gaierror are OSErrors
        return cause(e, timeout_s)
    answer = b""
    with conn:
        try:
            while len(answer) < len(greeting):
                chunk = conn.recv(len(greeting) - len(answer))
                if not chunk:
                    break
                answer += chunk
        except OSError:
            pass  # accepted, then silent or reset: not the doctor's listener
    if answer != greeting:
        return ("another program answered",
                "the name resolves to another machine than the node, or another program "
                "listens on the port there")
    return None


def probe_all(targets: Sequence[Tuple[str, int, bytes]],
              timeout_s: float = CONNECT_TIMEOUT_S) -> List[Optional[Tuple[str, str]]]:
    """`probe` of every (host, port, greeting), in parallel (a job of many nodes takes a
    few timeouts at most), in order."""
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(targets))) as pool:
        return list(pool.map(lambda t: probe(*t, timeout_s=timeout_s), targets))
