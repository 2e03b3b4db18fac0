// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
//
// fairplace-agent's BPF signal source: one read of a task iterator is one
// snapshot of the scheduler's state.
//
// What this program owns: turning the kernel's `struct rq` / `struct cfs_rq`
// of every CPU, and the runnable tasks, into fixed-size binary records that
// the agent decodes without parsing text (client/agent/src/bpf/record.rs is
// the other half of this layout; keep the two in step).
//
// Why an iterator: nothing runs until the agent reads, and each read is a
// fresh walk (no maps to keep in sync, no hooks on the scheduler's hot
// paths). The program is called once per task of the machine. The first
// call writes a header. A task is the way to its CPU's runqueue: the
// first task seen on a CPU leads, through its entity's cfs_rq
// (se.cfs_rq->rq), to that CPU's `struct rq`, and one record of the CPU is
// written then. Every CPU has tasks of its own (its per-CPU kernel
// threads, low pids, visited first), so every CPU is written early in the
// walk. Why not bpf_per_cpu_ptr(&runqueues, cpu): a typed __ksym of a
// data symbol needs the kernel's kallsyms to list data
// (CONFIG_KALLSYMS_ALL), which kernels built small leave out; the verifier
// then refuses the program. On every call it writes a record for a task
// that is queued (on_rq), or a short one for a task that ran since the
// agent's previous read (its runtime accounting); every other task costs
// a few loads and a compare. What one call writes stays far below the
// iterator's buffer (8 pages), past which a read fails with E2BIG.
//
// Why hand-written types: the structs below list only the fields read, with
// preserve_access_index, so libbpf relocates each access against the
// running kernel's BTF (/sys/kernel/btf/vmlinux) at load time; a generated
// vmlinux.h would be megabytes pinned to one kernel build. Fields renamed
// across kernel versions have a ___flavour struct and a
// bpf_core_field_exists() test, so one object loads on 5.15 to 6.18.

typedef unsigned char __u8;
typedef signed char __s8;
typedef unsigned short __u16;
typedef short __s16;
typedef unsigned int __u32;
typedef int __s32;
typedef unsigned long long __u64;
typedef long long __s64;
typedef __u16 __be16;
typedef __u32 __be32;
typedef __u64 __be64;
typedef __u32 __wsum;
typedef __u8 u8;
typedef __u16 u16;
typedef __u32 u32;
typedef __s32 s32;
typedef __u64 u64;
typedef __s64 s64;

#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#define PRESERVE __attribute__((preserve_access_index))

// Records (little-endian, natural alignment, sizes multiples of 8).
#define FP_REC_HEADER 1
#define FP_REC_CPU 2
#define FP_REC_TASK 3
#define FP_REC_RAN 4
#define FP_RECORD_VERSION 1

// CPUs reported (bpf_per_cpu_ptr returns NULL past nr_cpu_ids anyway), and
// the words of a task's affinity mask copied.
#define FP_MAX_CPUS 1024
#define FP_MASK_WORDS (FP_MAX_CPUS / 64)

#define PF_KTHREAD 0x00200000
#define TASK_ON_RQ_QUEUED 1

// ---- kernel types: only the fields read -------------------------------

struct load_weight {
	unsigned long weight;
} PRESERVE;

struct sched_avg {
	unsigned long load_avg;
	unsigned long runnable_avg;
	unsigned long util_avg;
	unsigned int util_est; // 6.9+
} PRESERVE;

// Before 6.9 util_est was a struct of two averages.
struct util_est {
	unsigned int enqueued;
	unsigned int ewma;
} PRESERVE;

struct sched_avg___old {
	struct util_est util_est;
} PRESERVE;

struct sched_entity {
	struct load_weight load;
	struct cfs_rq *cfs_rq;
	unsigned char on_rq;
	unsigned char sched_delayed; // 6.12+
	u64 exec_start;
	u64 sum_exec_runtime;
	struct sched_avg avg;
} PRESERVE;

struct rq;

struct cfs_rq {
	struct rq *rq;              // CONFIG_FAIR_GROUP_SCHED
	unsigned int nr_queued;     // 6.14+
	unsigned int h_nr_queued;   // 6.14+
	unsigned int h_nr_runnable; // 6.14+
	unsigned int h_nr_idle;     // 6.14+
	struct sched_avg avg;
} PRESERVE;

// The names of the same counts up to 6.13 (idle_h_nr_running from 5.13,
// h_nr_delayed in 6.12 and 6.13 only).
struct cfs_rq___old {
	unsigned int nr_running;
	unsigned int h_nr_running;
	unsigned int idle_h_nr_running;
	unsigned int h_nr_delayed;
} PRESERVE;

struct cpumask {
	unsigned long bits[FP_MASK_WORDS];
} PRESERVE;

struct signal_struct {
	int nr_threads;
} PRESERVE;

struct thread_info {
	u32 cpu; // THREAD_INFO_IN_TASK (x86, arm64, ... since 5.16)
} PRESERVE;

struct task_struct {
	struct thread_info thread_info;
	unsigned int __state;
	unsigned int flags;
	int on_rq;
	int static_prio;
	struct sched_entity se;
	unsigned int policy;
	int nr_cpus_allowed;
	const struct cpumask *cpus_ptr;
	unsigned short migration_disabled;
	int pid;
	int tgid;
	struct signal_struct *signal;
} PRESERVE;

// Before 5.16 the CPU was task_struct.cpu.
struct task_struct___old {
	unsigned int cpu;
} PRESERVE;

struct cpuidle_state {
	unsigned int exit_latency; // us
} PRESERVE;

struct rq {
	unsigned int nr_running;
	unsigned int ttwu_pending;
	struct cfs_rq cfs;
	struct task_struct *curr;
	struct task_struct *idle;
	u64 clock;
	u64 clock_task;
	unsigned long cpu_capacity;
	int cpu;
	int online;
	u64 idle_stamp;
	u64 avg_idle;
	struct cpuidle_state *idle_state; // CONFIG_CPU_IDLE
} PRESERVE;

// Up to 6.7 the rq kept the CPU's original capacity itself.
struct rq___old {
	unsigned long cpu_capacity_orig;
} PRESERVE;

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
	u64 session_id;
	u64 seq_num;
} PRESERVE;

struct bpf_iter__task {
	struct bpf_iter_meta *meta;
	struct task_struct *task;
} PRESERVE;

// ---- records (mirrored in record.rs) ----------------------------------

struct fp_header {
	u32 kind;
	u32 version;
	u32 nr_cpus;
	// The reading process in the initial pid namespace, the namespace of
	// every pid in the records: an agent in a container knows itself by
	// another pid.
	u32 reader_tgid;
	u64 ktime_ns;
};

// fp_cpu.flags
#define FP_CPU_PRESENT (1 << 0)
#define FP_CPU_HAS_RUNNABLE (1 << 1) // h_nr_runnable (or h_nr_delayed) known
#define FP_CPU_HAS_CAPACITY_ORIG (1 << 2)
#define FP_CPU_CURR_IDLE (1 << 3)
#define FP_CPU_ONLINE (1 << 4)
#define FP_CPU_IN_IDLE_STATE (1 << 5) // idle_exit_latency is the state's

struct fp_cpu {
	u32 kind;
	u32 cpu;
	u32 flags;
	u32 nr_running;
	u32 nr_queued;
	u32 h_nr_queued;
	u32 h_nr_runnable;
	u32 h_nr_idle;
	u32 curr_pid;
	u32 ttwu_pending;
	u64 load_avg;
	u64 runnable_avg;
	u64 util_avg;
	u64 util_est;
	u64 clock;
	u64 clock_task;
	u64 idle_stamp;
	u64 avg_idle;
	u64 capacity;
	u64 capacity_orig;
	u32 idle_exit_latency;
	u32 reserved;
};

// fp_task.flags (the kernel's task->flags is copied separately)
#define FP_TASK_SCHED_DELAYED (1 << 0)

struct fp_task {
	u32 kind;
	u32 pid;
	u32 tgid;
	u32 cpu;
	u32 policy;
	s32 static_prio;
	u32 task_flags;
	u32 nr_cpus_allowed;
	u32 nr_threads;
	u32 migration_disabled;
	u32 on_rq;
	u32 flags;
	u64 weight;
	u64 load_avg;
	u64 runnable_avg;
	u64 util_avg;
	u64 util_est;
	u64 sum_exec_runtime;
	u64 exec_start;
	u64 cpus_allowed[FP_MASK_WORDS];
};

struct fp_ran {
	u32 kind;
	u32 pid;
	u32 tgid;
	u32 cpu;
	u32 task_flags;
	u32 nr_threads;
	u64 sum_exec_runtime;
};

// ---- settings and per-read state --------------------------------------

// Set by the agent before load; read-only afterwards, so the verifier
// knows the loop bounds.
const volatile u32 nr_cpus = 1;
const volatile u32 max_tasks = 65536;

// Written by the agent before each read: per CPU, the clock_task its
// previous read saw. A sleeping task whose exec_start (its CPU's
// clock_task when it last ran) is not older ran since then. 0: list all.
u64 ran_since[FP_MAX_CPUS];

// Counted by the program during a read, for the agent's caps.
u32 tasks_written;

// The CPUs written in this read.
u64 cpus_written[FP_MASK_WORDS];

static __always_inline u64 util_est_of(struct sched_avg *avg)
{
	if (bpf_core_type_exists(struct util_est)) {
		struct sched_avg___old *o = (void *)avg;

		return BPF_CORE_READ(o, util_est.enqueued);
	}
	return avg->util_est;
}

static __always_inline u32 task_cpu_of(struct task_struct *t)
{
	struct task_struct___old *o = (void *)t;

	if (bpf_core_field_exists(o->cpu))
		return BPF_CORE_READ(o, cpu);
	return t->thread_info.cpu;
}

static __always_inline void read_cfs(struct fp_cpu *r, struct cfs_rq *cfs)
{
	struct cfs_rq___old *o = (void *)cfs;

	if (bpf_core_field_exists(cfs->h_nr_queued)) {
		r->nr_queued = cfs->nr_queued;
		r->h_nr_queued = cfs->h_nr_queued;
		r->h_nr_runnable = cfs->h_nr_runnable;
		r->h_nr_idle = cfs->h_nr_idle;
		r->flags |= FP_CPU_HAS_RUNNABLE;
	} else {
		r->nr_queued = BPF_CORE_READ(o, nr_running);
		r->h_nr_queued = BPF_CORE_READ(o, h_nr_running);
		if (bpf_core_field_exists(o->idle_h_nr_running))
			r->h_nr_idle = BPF_CORE_READ(o, idle_h_nr_running);
		// 6.12/6.13: runnable = queued - delayed; older: no delayed
		// dequeue, every queued entity is runnable.
		r->h_nr_runnable = r->h_nr_queued;
		if (bpf_core_field_exists(o->h_nr_delayed))
			r->h_nr_runnable -= BPF_CORE_READ(o, h_nr_delayed);
		r->flags |= FP_CPU_HAS_RUNNABLE;
	}
	r->load_avg = cfs->avg.load_avg;
	r->runnable_avg = cfs->avg.runnable_avg;
	r->util_avg = cfs->avg.util_avg;
	r->util_est = util_est_of(&cfs->avg);
}

static __noinline void write_cpu(struct seq_file *seq, struct rq *rq, u32 cpu)
{
	struct fp_cpu r = {};
	struct task_struct *curr;

	r.kind = FP_REC_CPU;
	r.cpu = cpu;
	r.flags = FP_CPU_PRESENT;
	if (rq->online)
		r.flags |= FP_CPU_ONLINE;
	r.nr_running = rq->nr_running;
	r.ttwu_pending = rq->ttwu_pending;
	read_cfs(&r, &rq->cfs);
	curr = rq->curr;
	if (curr) {
		r.curr_pid = curr->pid;
		if (curr == rq->idle)
			r.flags |= FP_CPU_CURR_IDLE;
	}
	r.clock = rq->clock;
	r.clock_task = rq->clock_task;
	r.idle_stamp = rq->idle_stamp;
	r.avg_idle = rq->avg_idle;
	r.capacity = rq->cpu_capacity;
	if (bpf_core_field_exists(((struct rq___old *)rq)->cpu_capacity_orig)) {
		r.capacity_orig = BPF_CORE_READ((struct rq___old *)rq, cpu_capacity_orig);
		r.flags |= FP_CPU_HAS_CAPACITY_ORIG;
	}
	if (bpf_core_field_exists(rq->idle_state)) {
		struct cpuidle_state *st = rq->idle_state;

		if (st) {
			r.idle_exit_latency = st->exit_latency;
			r.flags |= FP_CPU_IN_IDLE_STATE;
		}
	}
	bpf_seq_write(seq, &r, sizeof(r));
}

// The header, on the first call only; the per-read state starts again.
static __always_inline void write_header(struct seq_file *seq)
{
	struct fp_header h = {};

	h.kind = FP_REC_HEADER;
	h.version = FP_RECORD_VERSION;
	h.nr_cpus = nr_cpus;
	h.reader_tgid = bpf_get_current_pid_tgid() >> 32;
	h.ktime_ns = bpf_ktime_get_ns();
	bpf_seq_write(seq, &h, sizeof(h));
	tasks_written = 0;
	for (int i = 0; i < FP_MASK_WORDS; i++)
		cpus_written[i] = 0;
}

// The record of `cpu` if this read has none yet, through `t`'s cfs_rq.
static __always_inline void maybe_write_cpu(struct seq_file *seq, struct task_struct *t, u32 cpu)
{
	struct cfs_rq *cfs;
	struct rq *rq;
	u64 bit = 1ULL << (cpu & 63);
	u32 w = cpu / 64;

	// The verifier must see the index bounded where it is used.
	barrier_var(w);
	if (cpu >= nr_cpus || w >= FP_MASK_WORDS || (cpus_written[w] & bit))
		return;
	if (!bpf_core_field_exists(((struct cfs_rq *)0)->rq))
		return; // no group scheduling: the agent says the CPUs are missing
	cfs = t->se.cfs_rq;
	if (!cfs)
		return;
	rq = cfs->rq;
	if (!rq || rq->cpu != (int)cpu)
		return; // the task is moving: the next one of this CPU will do
	cpus_written[w] |= bit;
	write_cpu(seq, rq, cpu);
}

static __noinline void write_task(struct seq_file *seq, struct task_struct *t, u32 cpu)
{
	struct fp_task r = {};
	const struct cpumask *mask = t->cpus_ptr;
	struct signal_struct *sig = t->signal;

	r.kind = FP_REC_TASK;
	r.pid = t->pid;
	r.tgid = t->tgid;
	r.cpu = cpu;
	r.policy = t->policy;
	r.static_prio = t->static_prio;
	r.task_flags = t->flags;
	r.nr_cpus_allowed = t->nr_cpus_allowed;
	if (sig)
		r.nr_threads = sig->nr_threads;
	if (bpf_core_field_exists(t->migration_disabled))
		r.migration_disabled = t->migration_disabled;
	r.on_rq = t->on_rq;
	if (bpf_core_field_exists(t->se.sched_delayed) && t->se.sched_delayed)
		r.flags |= FP_TASK_SCHED_DELAYED;
	r.weight = t->se.load.weight;
	r.load_avg = t->se.avg.load_avg;
	r.runnable_avg = t->se.avg.runnable_avg;
	r.util_avg = t->se.avg.util_avg;
	r.util_est = util_est_of(&t->se.avg);
	r.sum_exec_runtime = t->se.sum_exec_runtime;
	r.exec_start = t->se.exec_start;
	if (mask) {
		for (int i = 0; i < FP_MASK_WORDS; i++) {
			if (i * 64 >= nr_cpus)
				break;
			r.cpus_allowed[i] = mask->bits[i];
		}
	}
	bpf_seq_write(seq, &r, sizeof(r));
}

SEC("iter/task")
int snapshot(struct bpf_iter__task *ctx)
{
	struct seq_file *seq = ctx->meta->seq;
	struct task_struct *t = ctx->task;
	struct signal_struct *sig;
	u32 cpu;
	u64 since;

	if (ctx->meta->seq_num == 0)
		write_header(seq);
	if (!t)
		return 0;
	cpu = task_cpu_of(t);
	maybe_write_cpu(seq, t, cpu);
	if (t->on_rq == TASK_ON_RQ_QUEUED) {
		if (tasks_written >= max_tasks)
			return 0;
		tasks_written++;
		write_task(seq, t, cpu);
		return 0;
	}
	since = cpu < FP_MAX_CPUS ? ran_since[cpu & (FP_MAX_CPUS - 1)] : 0;
	if (t->se.exec_start >= since) {
		struct fp_ran r = {};

		if (tasks_written >= max_tasks)
			return 0;
		tasks_written++;
		r.kind = FP_REC_RAN;
		r.pid = t->pid;
		r.tgid = t->tgid;
		r.cpu = cpu;
		r.task_flags = t->flags;
		sig = t->signal;
		if (sig)
			r.nr_threads = sig->nr_threads;
		r.sum_exec_runtime = t->se.sum_exec_runtime;
		bpf_seq_write(seq, &r, sizeof(r));
	}
	return 0;
}

// The kernel lets a program call GPL-only helpers (bpf_seq_write, the
// probed reads) only with a GPL-compatible license string: this file is
// offered under GPL-2.0 as well as the project's Apache-2.0.
char LICENSE[] SEC("license") = "GPL";
