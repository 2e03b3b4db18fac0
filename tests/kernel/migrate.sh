#!/usr/bin/env bash
# can_migrate_task() verdicts from the live kernel: boots the same guests as
# run.sh (Debian's Linux 6.12 cloud kernel under QEMU, the same topologies)
# without placements; the guest runs balancing workloads (piles of spinners
# started on one CPU, tasks allowed on two or three CPUs, SCHED_IDLE and
# nice mixes, cache-hot sleepers) and records every can_migrate_task() call
# it samples as a `can_migrate` scenario with the kernel's verdict, which
# compare_migrate.py checks against `fairplace-server decide`.
#
# Environment (besides run.sh's FP_KERNEL_TOPOLOGIES, FP_KERNEL_SEED,
# FP_KERNEL_JOBS):
#   FP_KERNEL_MIGRATIONS       verdicts per topology (default 300)
#   FP_KERNEL_MIN_MIGRATE_PCT  minimum agreement in percent (default 99.5)
#   FP_KERNEL_MIN_MIGRATE      fail when fewer verdicts were compared (default 0)
# The last line printed is
# `kernel can_migrate agreement A/N (P%) over T topologies`.
set -euo pipefail
export FP_KERNEL_PLACEMENTS=0
export FP_KERNEL_MIGRATIONS="${FP_KERNEL_MIGRATIONS:-300}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh"
