#!/usr/bin/env bash
# Migrations against the live kernel: can_migrate_task() verdicts, then whole
# load-balance passes (sched_balance_rq() calls). Boots the same guests as
# run.sh (Debian's Linux 6.12 cloud kernel under QEMU, the same topologies)
# without placements; the guest runs balancing workloads (piles of spinners
# started on one CPU, tasks allowed on two or three CPUs, SCHED_IDLE and
# nice mixes, cache-hot sleepers) and records every can_migrate_task() call
# it samples as a `can_migrate` scenario with the kernel's verdict, which
# compare_migrate.py checks against `fairplace-server decide`; then it records
# sampled sched_balance_rq() calls (periodic, idle and newly idle) as
# `balance` scenarios with the runqueues the pass walked, the busiest
# runqueues and the tasks detached, which compare_balance.py replays.
#
# Environment (besides run.sh's FP_KERNEL_TOPOLOGIES, FP_KERNEL_SEED,
# FP_KERNEL_JOBS):
#   FP_KERNEL_MIGRATIONS       verdicts per topology (default 300)
#   FP_KERNEL_MIN_MIGRATE_PCT  minimum agreement in percent (default 99.5)
#   FP_KERNEL_MIN_MIGRATE      fail when fewer verdicts were compared (default 0)
#   FP_KERNEL_PASSES           passes per topology (default 120)
#   FP_KERNEL_MIN_BALANCE_PCT  minimum pass agreement in percent (default 95)
#   FP_KERNEL_MIN_PASSES       fail when fewer passes that detached a task
#                              were compared (default 0)
# The last two lines printed are
# `kernel can_migrate agreement A/N (P%) over T topologies` and
# `kernel balance agreement A/N (P%) over T topologies; R passes, S set aside`.
set -euo pipefail
export FP_KERNEL_PLACEMENTS=0
export FP_KERNEL_MIGRATIONS="${FP_KERNEL_MIGRATIONS:-300}"
export FP_KERNEL_PASSES="${FP_KERNEL_PASSES:-120}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh"
