"""`python -m rawgpu.launch`: start the ranks of one host of a job on several (the part torchrun plays, without it).

    python -m rawgpu.launch --nnodes 2 --node-rank 0 --master-addr node0:29500 --nproc-per-node 4 -- --hidden 8192
    python -m rawgpu.launch --command sweep ... -- --lr 0.01 0.02 0.05 0.1 --seeds 0-15 --out sweep

Run it once on each host, with that host's --node-rank: it starts --nproc-per-node processes of `rawgpu.train`
(or `rawgpu.sweep`: --command; the arguments after --), each with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
so each is one rank on GPU LOCAL_RANK of this host; they meet at the master's address (rank 0 is local rank 0 of
node 0). The job ends itself when a rank fails (jobs/job.py); this launcher then waits for its ranks and exits
with the first failure's status. Ctrl-C reaches every rank of this host, which ends the job on every host.
"""

from __future__ import annotations

import argparse
import sys

from ..jobs.processes import run, start, visible_gpus
from .common import add_version_option, count, program

def address(text: str) -> tuple[str, int]:
    """An argparse type: HOST:PORT (a port 1..65535)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 1..65535, got {text!r}")
    return host.strip("[]"), int(port)  # [::1]:29500 names an IPv6 host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program("launch"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 when every local rank ended well, else the first failed rank's status; 2 bad "
               "arguments.")
    p.add_argument("--nnodes", type=count(1, 4096, what="hosts"), default=1, help="hosts in the job (default 1)")
    p.add_argument("--node-rank", type=count(0, what="index"), default=0,
                   help="this host's index, 0..nnodes-1 (default 0); node 0 holds rank 0")
    p.add_argument("--master-addr", type=address, default=("127.0.0.1", 29500), metavar="HOST:PORT",
                   help="node 0's address every host reaches, and a free port there (default 127.0.0.1:29500, "
                        "one host)")
    p.add_argument("--nproc-per-node", type=count(1, 64, what="processes"), required=True, metavar="G",
                   help="ranks on this host, one per GPU: GPUs 0..G-1 of those CUDA_VISIBLE_DEVICES shows")
    p.add_argument("--command", choices=COMMANDS, default="train",
                   help="what every rank runs: python -m rawgpu.train (default) or rawgpu.sweep (each rank trains its "
                        "share of the grid; rank 0 writes the results)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                   help="the arguments of that command, after --")
    add_version_option(p)
    return p


COMMANDS = ("train", "sweep")


def command_main(command: str):
    """The CLI module whose main() every rank runs."""
    from . import sweep, train

    return {"train": train, "sweep": sweep}[command]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.node_rank >= args.nnodes:
        parser.error(f"argument --node-rank: {args.node_rank} is not below --nnodes {args.nnodes}")
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    for banned in ("--gpus", "--device"):
        if any(a == banned or a.startswith(banned + "=") for a in train_args):
            parser.error(f"{banned} is not for the ranks: each rank takes GPU LOCAL_RANK; --nproc-per-node sets "
                         "how many")
    command_main(args.command).build_parser().parse_args(train_args)  # a bad argument: one line here, not per rank
    if (gpus := visible_gpus()) is not None and args.nproc_per_node > gpus:
        parser.error(f"argument --nproc-per-node: {args.nproc_per_node} ranks, this host has {gpus} GPUs")
    main_of_rank = command_main(args.command).main
    return run(lambda: start(main_of_rank, train_args, args.nproc_per_node, args.nnodes, args.node_rank,
                             args.master_addr),
               args.node_rank * args.nproc_per_node, "rawgpu.launch: interrupted: every rank of this host stopped")


if __name__ == "__main__":
    sys.exit(main())
