"""Rendezvous through torch's c10d Store (TCPStore, FileStore, torchrun's agent store)."""

from asyncrpc.rendezvous.store import (
    Store,
    create_store,
    exchange,
    free_port,
    gather,
    job_secret,
    listen_host_for,
    open_job,
)

__all__ = (
    "Store",
    "create_store",
    "exchange",
    "free_port",
    "gather",
    "job_secret",
    "listen_host_for",
    "open_job",
)
