#!/usr/bin/env bash
# Kernel fidelity harness: boots Debian's Linux 6.12 cloud kernel under QEMU
# (TCG) on several topologies with a busybox initramfs whose init is the
# static test program of tests/kernel/guest, collects the placements the
# kernel made as scenarios (kernel "6.12", the kernel's CPU under expected),
# and compares them with `fairplace-server decide` (tests/kernel/compare.py).
#
# Environment:
#   FP_KERNEL_PLACEMENTS  placements per topology (default 420; big32 a
#                         quarter of it), shared out equally among the seeds;
#                         FP_KERNEL_PLACEMENTS_<topology, - as _> sets one
#   FP_KERNEL_JOBS        guests run at a time (default 2)
#   FP_KERNEL_TOPOLOGIES  space-separated subset of the topologies in
#                         qemu_args below (default: all eight)
#   FP_KERNEL_PROFILES    space-separated load profiles, one chosen per round
#                         by the seed: light busy oversubscribed llc-full
#                         cgroups wake-storm exec-heavy (default: all)
#   FP_KERNEL_SEED        space-separated seeds (default "1 2 3")
#   FP_KERNEL_MIN         minimum agreement in percent (default 99.5)
#   FP_KERNEL_MIN_COMPARED  fail when fewer placements were compared (default 0)
#   FP_KERNEL_MAX_SET_ASIDE fail when more records (percent, rounded up to a whole
#                         record) were set aside (default 3)
#   FP_KERNEL_MIN_SGC     fail when fewer records with the sgc_imbalance hint were compared (default 0)
#   FP_KERNEL_MIGRATIONS  can_migrate_task() verdicts per topology recorded
#                         after the placements (default 0; tests/kernel/migrate.sh
#                         sets it), compared by compare_migrate.py
#   FP_KERNEL_MIN_MIGRATE fail when fewer verdicts were compared (default 0)
#   FP_KERNEL_PASSES      whole load-balance passes per topology recorded last
#                         (FP_KERNEL_PASSES_<topology> sets one; big32 a quarter)
#                         (default 0; migrate.sh sets it), compared by
#                         compare_balance.py
#   FP_KERNEL_MIN_PASSES  fail when fewer passes that detached a task were
#                         compared (default 0)
# The last line printed is
# `kernel agreement A/N (P%) over T topologies, kernel K; R records, S set aside`,
# or with FP_KERNEL_PLACEMENTS=0 (migrate.sh)
# `kernel can_migrate agreement A/N (P%) over T topologies` and then
# `kernel balance agreement A/N (P%) over T topologies; R passes, S set aside`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="$ROOT/target/kernel-fidelity"
PLACEMENTS="${FP_KERNEL_PLACEMENTS:-420}"
ALL_TOPOLOGIES="smt2-numa smt1-llc8 two-llc-node smt4 numa4 many-llc16 smt2-2llc16 big32"
TOPOLOGIES="${FP_KERNEL_TOPOLOGIES:-$ALL_TOPOLOGIES}"
export FP_KERNEL_PROFILES="${FP_KERNEL_PROFILES:-light busy oversubscribed llc-full cgroups wake-storm exec-heavy}"
PROFILES="$FP_KERNEL_PROFILES"
SEEDS="${FP_KERNEL_SEED:-1 2 3}"
MIN="${FP_KERNEL_MIN:-99.5}"
MIGRATIONS="${FP_KERNEL_MIGRATIONS:-0}"
PASSES="${FP_KERNEL_PASSES:-0}"
export FP_KERNEL_MAX_SET_ASIDE="${FP_KERNEL_MAX_SET_ASIDE:-3}"
mkdir -p "$WORK"
log() { echo "kernel-fidelity: $*" >&2; }

# 1. Tools and the kernel, through apt.
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -x /bin/busybox ] && /bin/busybox --list 2>/dev/null | grep -qx dmesg || need+=(busybox-static)
command -v cpio >/dev/null || need+=(cpio)
if [ ! -s "$WORK/kernel/vmlinuz" ] || [ ! -s "$WORK/kernel/config" ] || [ ${#need[@]} -gt 0 ]; then
    log "apt-get update"
    apt-get update -q >/dev/null
fi
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null
fi
if [ ! -s "$WORK/kernel/vmlinuz" ] || [ ! -s "$WORK/kernel/config" ]; then
    pkg="$(apt-cache search --names-only '^linux-image-6\.12\..*-cloud-amd64-unsigned$' \
        | awk '{print $1}' | sort -V | tail -1)"
    [ -n "$pkg" ] || { log "no linux-image-6.12.*-cloud-amd64-unsigned package"; exit 1; }
    log "downloading $pkg"
    rm -rf "$WORK/kernel" "$WORK/deb" && mkdir -p "$WORK/kernel" "$WORK/deb"
    (cd "$WORK/deb" && apt-get download "$pkg" >/dev/null 2>&1)
    dpkg-deb -x "$WORK"/deb/*.deb "$WORK/deb/x"
    cp "$WORK"/deb/x/boot/vmlinuz-* "$WORK/kernel/vmlinuz"
    cp "$WORK"/deb/x/boot/config-* "$WORK/kernel/config"
    rm -rf "$WORK/deb"
fi

# 2. The static guest program, the decide binary and the agent.
log "building the guest program (static) and fairplace"
(cd "$ROOT/tests/kernel/guest" && RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --quiet --target x86_64-unknown-linux-gnu)
GUEST="$ROOT/tests/kernel/guest/target/x86_64-unknown-linux-gnu/release/fairplace-kernel-guest"
(cd "$ROOT" && cargo build --quiet -p fairplace-server --bin fairplace-server -p fairplace-agent --bin fairplace-agent)
DECIDE="$ROOT/target/debug/fairplace-server"
AGENT="$ROOT/target/debug/fairplace-agent"

# 3. The initramfs: /init is the guest program; busybox for dmesg; the
#    agent with its dynamic loader and libraries when it has --print-once.
IRD="$WORK/initramfs"
rm -rf "$IRD" && mkdir -p "$IRD"/{bin,dev,proc,sys,tmp}
cp "$GUEST" "$IRD/init"
cp /bin/busybox "$IRD/bin/busybox"
if "$AGENT" --help 2>/dev/null | grep -q -- '--print-once'; then
    cp "$AGENT" "$IRD/bin/fairplace-agent"
    for lib in $(ldd "$AGENT" | grep -o '/[^ ]*'); do
        mkdir -p "$IRD$(dirname "$lib")"
        cp -L "$lib" "$IRD$lib"
    done
fi
(cd "$IRD" && find . | cpio -o -H newc --quiet | gzip -1 >"$WORK/initrd.gz")

# 4. Boot each topology.
# Each topology: memory, -smp and the CPU model, NUMA nodes. Skylake-Server
# gives SMT4 and one LLC per die; EPYC with topoext one LLC per socket.
numa_nodes() { # size cpus-of-node-0 cpus-of-node-1 ...
    local size=$1 i=0
    shift
    for cpus in "$@"; do
        echo "-object memory-backend-ram,id=m$i,size=$size -numa node,nodeid=$i,cpus=$cpus,memdev=m$i"
        i=$((i + 1))
    done
}
qemu_args() {
    case "$1" in
    smt2-numa)
        echo "-m 1024 -smp 8,sockets=2,cores=2,threads=2 -cpu EPYC,+topoext $(numa_nodes 512M 0-3 4-7)" ;;
    smt1-llc8) echo "-m 1024 -smp 8,sockets=1,cores=8,threads=1 -cpu EPYC" ;;
    two-llc-node) echo "-m 1024 -smp 8,sockets=2,cores=4,threads=1 -cpu EPYC" ;;
    # SMT4 cores, one LLC.
    smt4) echo "-m 1024 -smp 8,sockets=1,cores=2,threads=4 -cpu Skylake-Server" ;;
    # Four nodes of two CPUs with unequal distances: three NUMA levels
    # (16, 22, 28), overlapping groups, imb_numa_nr.
    numa4)
        echo "-m 2048 -smp 8,sockets=4,cores=2,threads=1 -cpu Skylake-Server $(numa_nodes 512M 0-1 2-3 4-5 6-7)" \
            "-numa dist,src=0,dst=1,val=16 -numa dist,src=0,dst=2,val=22 -numa dist,src=0,dst=3,val=28" \
            "-numa dist,src=1,dst=2,val=16 -numa dist,src=1,dst=3,val=22 -numa dist,src=2,dst=3,val=16" ;;
    # No SMT, four small LLCs (one per die) in one package.
    many-llc16) echo "-m 1024 -smp 16,sockets=1,dies=4,cores=4,threads=1 -cpu Skylake-Server" ;;
    # SMT2, two LLCs of eight CPUs in one package.
    smt2-2llc16) echo "-m 1024 -smp 16,sockets=1,dies=2,cores=4,threads=2 -cpu Skylake-Server" ;;
    # Two sockets (nodes) of two LLCs of four SMT2 cores: SIS_UTIL limits
    # the scan of an 8-CPU LLC, and the slow path has four levels.
    big32) echo "-m 2048 -smp 32,sockets=2,dies=2,cores=4,threads=2 -cpu Skylake-Server $(numa_nodes 1024M 0-15 16-31)" ;;
    *) log "unknown topology $1"; exit 1 ;;
    esac
}
# The guest needs the kernel's HZ (record_wakee() decays a waker's flips
# once a second of jiffies has passed); it is a build option.
HZ_CONFIG="$(sed -n 's/^CONFIG_HZ=//p' "$WORK/kernel/config")"
# Placements per topology: FP_KERNEL_PLACEMENTS_<name, - as _> if set; a
# 32-CPU guest places a task in about ten seconds under TCG on two host
# CPUs, so big32 makes a quarter of the others' unless told.
placements_for() {
    local v="FP_KERNEL_PLACEMENTS_${1//-/_}" def="$PLACEMENTS"
    [ "$1" = big32 ] && def=$((PLACEMENTS / 4))
    echo "${!v:-$def}"
}
# Passes per topology likewise: FP_KERNEL_PASSES_<name>, a quarter on big32
# (each of its passes writes 64 events, read back under TCG).
passes_for() {
    local v="FP_KERNEL_PASSES_${1//-/_}" def="$PASSES"
    [ "$1" = big32 ] && def=$((PASSES / 4))
    echo "${!v:-$def}"
}
# Placement records land in $WORK/<topology>.log; a run without placements
# (migrate.sh) keeps its logs apart, so the two never overwrite each other.
LOGDIR="$WORK"
[ "$PLACEMENTS" = 0 ] && LOGDIR="$WORK/migrate" && mkdir -p "$LOGDIR"
boot_guest() { # topology log placements passes
    # One host thread for all vCPUs: multi-threaded TCG now and then
    # crashes the guest while it patches its own text, and sets aside more
    # records (a vCPU stalls inside a decision) for little speed.
    # shellcheck disable=SC2046
    timeout --foreground "$((600 + 12 * $3 + MIGRATIONS + 3 * $4))" qemu-system-x86_64 -accel tcg,thread=single $(qemu_args "$1") \
        -kernel "$WORK/kernel/vmlinuz" -initrd "$WORK/initrd.gz" \
        -append "console=ttyS0 quiet loglevel=1 sched_verbose noautogroup cpuidle.off=1 panic=-1 fp.n=$3 fp.seed=${SEEDS// /,} fp.profiles=${PROFILES// /,} fp.hz=$HZ_CONFIG fp.migrations=$MIGRATIONS fp.passes=$4" \
        -display none -monitor none -serial "file:$2" -no-reboot 2>"$WORK/$1.qemu.err" || true
}
run_topology() { # topology: boots it (again after an early crash), prints its line
    local t=$1 out="$LOGDIR/$1.log" n start end boot
    n=$(placements_for "$t")
    log "booting $t ($n placements, seeds $SEEDS, profiles $PROFILES)"
    # Under TCG a guest kernel now and then dies on an int3 while it patches
    # its own text (jump labels), before the test program has recorded
    # anything. Such a guest is booted again (twice at most) and the crash
    # is reported; a guest that gave records is never booted again.
    for attempt in 1 2 3; do
        rm -f "$out"
        start=$(date +%s.%N)
        boot_guest "$t" "$out" "$n" "$(passes_for "$t")"
        end=$(date +%s.%N)
        grep -q '^SCN\|^MIG \|^LB ' "$out" && break
        grep -q 'Oops\|Kernel panic' "$out" || break
        log "$t: the guest kernel crashed before the first record (attempt $attempt): $(grep -m1 'RIP:' "$out" | tr -d '\r')"
    done
    # The kernel's clock at its last sched_verbose line: boot to init.
    boot=$(sed -n 's/^KDOM \[ *\([0-9.]*\)\].*/\1/p' "$out" | tail -1)
    printf '%s: guest ran %.1f s (kernel booted in %s s of it), %s records\n' \
        "$t" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')" "${boot:-?}" "$(grep -c '^SCN\|^MIG \|^LB ' "$out" || true)" \
        >"$LOGDIR/$t.summary"
}
# Stopped by a signal (a `timeout` around this script, Ctrl-C) or ending
# any way, no guest outlives the run: each guest's own `timeout` runs in
# the foreground (no process group of its own that a signal to this run's
# group would miss), and the guests of this run, found by their kernel
# path, are killed on the way out.
end_guests() { pkill -KILL -f -- "-kernel $WORK/kernel/vmlinuz" 2>/dev/null || true; }
trap 'end_guests; trap - EXIT; exit 143' TERM INT HUP
trap end_guests EXIT
# FP_KERNEL_JOBS guests at a time (default 2: each uses one host CPU).
JOBS="${FP_KERNEL_JOBS:-2}"
logs=()
for t in $TOPOLOGIES; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    rm -f "$LOGDIR/$t.summary"
    run_topology "$t" &
    logs+=("$LOGDIR/$t.log")
done
wait
for t in $TOPOLOGIES; do cat "$LOGDIR/$t.summary" 2>/dev/null || echo "$t: no summary"; done

# 5. Compare: the verdicts, then the placements (whose line comes last).
rc=0
if [ "$MIGRATIONS" != 0 ]; then
    python3 "$ROOT/tests/kernel/compare_migrate.py" "$DECIDE" "${FP_KERNEL_MIN_MIGRATE_PCT:-99.5}" "${logs[@]}" || rc=1
fi
if [ "$PASSES" != 0 ]; then
    python3 "$ROOT/tests/kernel/compare_balance.py" "$DECIDE" "${FP_KERNEL_MIN_BALANCE_PCT:-95}" "${logs[@]}" || rc=1
fi
if [ "$PLACEMENTS" != 0 ]; then
    python3 "$ROOT/tests/kernel/compare.py" "$DECIDE" "$MIN" "${logs[@]}" || rc=1
fi
exit $rc
