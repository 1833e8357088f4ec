"""Horovod's own Gloo rendezvous server for one job, as ``horovodrun --gloo`` and ``horovod.ray`` start it.

    python benchmarks/cluster_rendezvous.py node0:1,node1:1

Prints the port it listens on (all addresses of the namespace it runs in), then serves until its
standard input closes.
"""

from __future__ import annotations

import sys

from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer


def main() -> None:
    hosts = parse_hosts(sys.argv[1])
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(hosts, sum(host.slots for host in hosts)))
    print(port, flush=True)
    sys.stdin.read()
    server.stop()


if __name__ == "__main__":
    main()
