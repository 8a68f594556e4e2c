"""Operator commands for the tag scheduler, over NATS request/reply (sf.sched.ctl).

    seamlessflow hosts list                     # tags, mode, epoch, health, what each host does now
    seamlessflow hosts cordon host-1            # take it out of placement (drain: cordon, then it is vacated)
    seamlessflow hosts uncordon host-1
    seamlessflow hosts policy seamless          # switch policy on a running cluster
    seamlessflow timeline --out timeline.json   # every host's activity intervals and idle fractions

Connections come from SF_NATS_URL, or the stack `seamlessflow up` runs from --data-dir.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from shared import bus, subjects
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages.scheduler import SchedulerControl, SchedulerReply, fractions


async def ask(conn: Connections, op: str, host: str | None = "", policy: str | None = "",
              timeout: float = 10.0) -> SchedulerReply:
    """One control request; SystemExit with the scheduler's error, or when none runs. A missing host
    or policy (None: an optional argument not given) is sent as "", as the control message says."""
    ctl = SchedulerControl(op=op, host=host or "", policy=policy or "")
    nc = await bus.connect(conn, name="sf-ops")
    try:
        data = await bus.request(nc, subjects.SCHED_CTL, encode(ctl), timeout)
    except bus.BusUnavailable:
        raise SystemExit("error: no scheduler is running (start the stack with --policy)") from None
    finally:
        await bus.wait_closed(nc)
    reply = decode(data, SchedulerReply)
    if not reply.ok:
        raise SystemExit(f"error: {reply.error}")
    return reply


def format_hosts(reply: SchedulerReply) -> str:
    now = time.time()
    rows = [f"policy {reply.policy}; " + ", ".join(f"{k} {v}" for k, v in sorted(reply.counts.items()))]
    if reply.rates:
        rows.append("rates: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(reply.rates.items())))
    rows.append(f"{'host':<10} {'tags':<24} {'mode':<8} {'target':<8} {'epoch':>5}  {'health':<9} {'now':<8} seen")
    for h in sorted(reply.hosts, key=lambda h: h.host):
        health = ("cordoned" if h.cordoned else "ok") if h.healthy else "DEAD"
        rows.append(f"{h.host:<10} {','.join(h.tags):<24} {h.mode:<8} {h.target:<8} {h.epoch:>5}  {health:<9} "
                    f"{h.activity:<8} {now - h.last_seen:.1f}s ago")
    return "\n".join(rows)


def timeline_doc(reply: SchedulerReply) -> dict:
    """{"policy", "hosts": {id: {"intervals": [[activity, t0, t1]...], "fractions": {...}}}}"""
    hosts = {}
    for h in reply.hosts:
        ivs = h.timeline
        t0 = ivs[0].t_start if ivs else 0.0
        hosts[h.host] = {"tags": h.tags, "intervals": [[iv.activity, iv.t_start, iv.t_end] for iv in ivs],
                         "fractions": fractions(ivs, t0)}
    rates = {k: (v if math.isfinite(v) else None) for k, v in reply.rates.items()}  # JSON has no infinity
    return {"policy": reply.policy, "counts": reply.counts, "rates": rates, "hosts": hosts}


def write_timeline(reply: SchedulerReply, out: Path) -> str:
    doc = timeline_doc(reply)
    out.write_text(json.dumps(doc, indent=1))
    lines = [f"wrote {out}: {len(doc['hosts'])} host(s)"]
    for host, d in sorted(doc["hosts"].items()):
        f = d["fractions"]
        lines.append(f"  {host}: " + ", ".join(f"{k} {v:.0%}" for k, v in f.items()))
    return "\n".join(lines)
