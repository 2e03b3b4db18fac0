#!/usr/bin/env bash
# Kernel fidelity harness: boots Debian's Linux 6.12 cloud kernel under QEMU
# (TCG) on several topologies with a busybox initramfs whose init is the
# static test program of tests/kernel/guest, collects the placements the
# kernel made as scenarios (kernel "6.12", the kernel's CPU under expected),
# and compares them with `fairplace-server decide` (tests/kernel/compare.py).
#
# Environment:
#   FP_KERNEL_PLACEMENTS  placements per topology (default 150)
#   FP_KERNEL_TOPOLOGIES  space-separated subset of: smt2-numa smt1-llc8 two-llc-node
#   FP_KERNEL_MIN         minimum agreement in percent (default 97)
#   FP_KERNEL_SEED        seed of the experiments (default 1)
#   FP_KERNEL_MIN_COMPARED  fail when fewer placements were compared (default 0)
# The last line printed is `kernel agreement A/N (P%) over T topologies, kernel K`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="$ROOT/target/kernel-fidelity"
PLACEMENTS="${FP_KERNEL_PLACEMENTS:-150}"
TOPOLOGIES="${FP_KERNEL_TOPOLOGIES:-smt2-numa smt1-llc8 two-llc-node}"
MIN="${FP_KERNEL_MIN:-97}"
SEED="${FP_KERNEL_SEED:-1}"
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
qemu_args() {
    case "$1" in
    smt2-numa)
        echo "-smp 8,sockets=2,cores=2,threads=2 -cpu EPYC,+topoext" \
            "-object memory-backend-ram,id=m0,size=512M -object memory-backend-ram,id=m1,size=512M" \
            "-numa node,nodeid=0,cpus=0-3,memdev=m0 -numa node,nodeid=1,cpus=4-7,memdev=m1" ;;
    smt1-llc8) echo "-smp 8,sockets=1,cores=8,threads=1 -cpu EPYC" ;;
    two-llc-node) echo "-smp 8,sockets=2,cores=4,threads=1 -cpu EPYC" ;;
    *) log "unknown topology $1"; exit 1 ;;
    esac
}
# The guest needs the kernel's HZ (record_wakee() decays a waker's flips
# once a second of jiffies has passed); it is a build option.
HZ_CONFIG="$(sed -n 's/^CONFIG_HZ=//p' "$WORK/kernel/config")"
logs=()
boot_guest() {
    # shellcheck disable=SC2046
    timeout 1200 qemu-system-x86_64 -m 1024 $(qemu_args "$1") \
        -kernel "$WORK/kernel/vmlinuz" -initrd "$WORK/initrd.gz" \
        -append "console=ttyS0 quiet loglevel=1 sched_verbose noautogroup cpuidle.off=1 panic=-1 fp.n=$PLACEMENTS fp.seed=$SEED fp.hz=$HZ_CONFIG" \
        -display none -monitor none -serial "file:$2" -no-reboot 2>"$WORK/$1.qemu.err" || true
}
for t in $TOPOLOGIES; do
    out="$WORK/$t.log"
    log "booting $t ($PLACEMENTS placements)"
    # Under TCG a guest kernel now and then dies on an int3 while it patches
    # its own text (jump labels), before the test program has recorded
    # anything. Such a guest is booted again (twice at most) and the crash
    # is reported; a guest that gave records is never booted again.
    for attempt in 1 2 3; do
        rm -f "$out"
        start=$(date +%s.%N)
        boot_guest "$t" "$out"
        end=$(date +%s.%N)
        grep -q '^SCN' "$out" && break
        grep -q 'Oops\|Kernel panic' "$out" || break
        log "$t: the guest kernel crashed before the first record (attempt $attempt): $(grep -m1 'RIP:' "$out" | tr -d '\r')"
    done
    # The kernel's clock at its last sched_verbose line: boot to init.
    boot=$(sed -n 's/^KDOM \[ *\([0-9.]*\)\].*/\1/p' "$out" | tail -1)
    printf '%s: guest ran %.1f s (kernel booted in %s s of it), %s records\n' \
        "$t" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')" "${boot:-?}" "$(grep -c '^SCN' "$out" || true)"
    logs+=("$out")
done

# 5. Compare.
python3 "$ROOT/tests/kernel/compare.py" "$DECIDE" "$MIN" "${logs[@]}"
