// Runtime: ISA dispatch, the persistent thread pool, and the C API for matmul.
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "smk.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SMK_X86 1
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() {}
#endif

namespace smk {

// ---- ISA ------------------------------------------------------------------------------------
namespace {

enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_VNNI = 3 };
const char* kIsaNames[] = {"scalar", "avx2", "avx512bw", "avx512vnni"};

int detect_isa() {
#ifdef SMK_X86
    __builtin_cpu_init();
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    bool vnni = avx512 && __builtin_cpu_supports("avx512vnni");
    return vnni ? ISA_VNNI : avx512 ? ISA_AVX512 : avx2 ? ISA_AVX2 : ISA_SCALAR;
#else
    return ISA_SCALAR;
#endif
}

Kernels g_tables[4];
int g_best = -1;
// The format whose VNNI kernel has a VBMI variant (dot_avx512vbmi.cpp), and both variants: the VBMI
// one is in the table where the CPU has VBMI (smk_set_vbmi switches, for tests and benchmarks).
constexpr int kVbmiType = T_IQ3_XXS;
DotRowsFn g_iq_plain = nullptr, g_iq_vbmi = nullptr;
std::atomic<int> g_isa{-1};
std::once_flag g_init_once;
// Per-type choices made by the calibration at load (kernels/tuning.py): a type's kernels from a
// lower ISA's table, or its weights left in place where the packed kernel measured slower. The
// table in use is then g_mixed: the ISA's own, with those entries swapped. Set while a process
// loads its weights, before any product runs on them.
struct TypeChoice { int isa = -1; bool pack = true; };
TypeChoice g_choice[64];
Kernels g_mixed;
std::atomic<bool> g_use_mixed{false};

void init_tables() {
    g_best = detect_isa();
    init_scalar(g_tables[ISA_SCALAR]);
    init_packed_scalar(g_tables[ISA_SCALAR]);
    init_attention_scalar(g_tables[ISA_SCALAR]);
#ifdef SMK_X86
    g_tables[ISA_AVX2] = g_tables[ISA_SCALAR];
    init_avx2(g_tables[ISA_AVX2]);
    init_attention_avx2(g_tables[ISA_AVX2]);
    g_tables[ISA_AVX512] = g_tables[ISA_AVX2];
    init_avx512(g_tables[ISA_AVX512]);
    init_attention_avx512(g_tables[ISA_AVX512]);
    g_tables[ISA_VNNI] = g_tables[ISA_AVX512];
    init_avx512vnni(g_tables[ISA_VNNI]);
    g_iq_plain = g_tables[ISA_VNNI].dot[kVbmiType];
    if (g_best == ISA_VNNI && __builtin_cpu_supports("avx512vbmi")) {
        Kernels k = g_tables[ISA_VNNI];
        init_avx512vbmi(k);
        g_iq_vbmi = g_tables[ISA_VNNI].dot[kVbmiType] = k.dot[kVbmiType];
    }
#endif
    int isa = g_best;
    // SPLITMOE_KERNELS_ISA lowers the ISA (debugging, benchmarks); it never raises it.
    if (const char* env = std::getenv("SPLITMOE_KERNELS_ISA")) {
        for (int i = 0; i < 4; ++i)
            if (!std::strcmp(env, kIsaNames[i]) && i <= g_best) isa = i;
    }
    g_isa.store(isa);
}

}  // namespace

const Kernels& kernels() {
    std::call_once(g_init_once, init_tables);
    if (g_use_mixed.load(std::memory_order_relaxed)) return g_mixed;
    return g_tables[g_isa.load(std::memory_order_relaxed)];
}

namespace {

int isa_index(const char* name) {
    for (int i = 0; i < 4; ++i)
        if (name && !std::strcmp(name, kIsaNames[i])) return i;
    return -1;
}

void rebuild_mixed() {
    const int base = g_isa.load();
    bool any = false;
    g_mixed = g_tables[base];
    for (int t = 0; t < 64; ++t) {
        const TypeChoice& c = g_choice[t];
        if (c.isa >= 0 && c.isa != base) {
            g_mixed.dot[t] = g_tables[c.isa].dot[t];
            g_mixed.packed[t] = g_tables[c.isa].packed[t];
            g_mixed.packed_fast[t] = g_tables[c.isa].packed_fast[t];
            any = true;
        }
        if (!c.pack && g_mixed.packed_fast[t]) {
            g_mixed.packed_fast[t] = false;
            any = true;
        }
    }
    g_use_mixed.store(any);
}

}  // namespace

// ---- thread pool ----------------------------------------------------------------------------
namespace {

// Workers spin this long for the next job before sleeping on the condition variable: long
// enough to bridge the gaps between the phases of one MoE layer, short enough not to burn a
// shared core between requests.
constexpr auto kSpin = std::chrono::microseconds(100);

// smk_park() bumps this: workers spinning for a next job stop at once and sleep. A process calls
// it when it hands the cores to another one (the attention side waiting for its expert services,
// an expert service that has answered): spinning then would only slow down the side that computes.
std::atomic<uint64_t> g_park_epoch{0};

// CPUs the pool's workers are pinned to (smk_pin_workers): worker i runs on g_worker_cpus[i %
// size] of the list; empty: not pinned. Guarded by g_pool_mu.
std::vector<int> g_worker_cpus;

void pin_thread(std::thread& t, int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(t.native_handle(), sizeof(set), &set);  // a CPU not allowed: stays unpinned
}

// ---- keeping the CPUs awake between jobs ------------------------------------------------------
// On a virtual machine whose idle vCPUs halt at once (no halt polling: Firecracker's default, and
// this project's test machines), waking a thread on a halted vCPU costs the host's reschedule of
// that vCPU: a sleeping worker took ~150 µs to join a job here, against ~10 µs on a vCPU that is
// running something. So, for g_awake_ms after the last job, one thread per CPU of the pool spins in
// the idle scheduling class (SCHED_IDLE): it runs only when nothing else of its scheduling group
// wants that CPU, keeps the vCPU from halting, and computes nothing; after g_awake_ms without a job
// it sleeps too. Measured: a 4096x2048 GEMV on 2 threads after a 2 ms pause, 195 µs with halting
// vCPUs, 57 with them kept awake (40 back to back); in-process prefill +7%. A process that hands its
// cores to another (the services) stops them: see smk_park.
std::atomic<int> g_awake_ms{20};
std::atomic<int64_t> g_last_job_ns{0};

int64_t now_ns_steady() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Awake {
    // Class and CPU set by the maker, so that both hold when the pool's first job returns.
    explicit Awake(const std::vector<int>& cpus) {
        for (int cpu : cpus) {
            std::thread t([this] { loop(); });
            sched_param param{};
            if (pthread_setschedparam(t.native_handle(), SCHED_IDLE, &param) != 0) {
                { std::lock_guard<std::mutex> lk(mu); stop = true; }  // never a spinner at normal priority
                cv.notify_all();
                t.join();
                break;
            }
            // On its pool thread's CPU; unpinned pools: anywhere the process may run (not only where
            // the thread that made the pool happens to be pinned).
            cpu_set_t set;
            CPU_ZERO(&set);
            if (cpu >= 0) CPU_SET(cpu, &set);
            if (cpu >= 0 || sched_getaffinity(getpid(), sizeof(set), &set) == 0)
                pthread_setaffinity_np(t.native_handle(), sizeof(set), &set);
            threads.push_back(std::move(t));
        }
    }
    ~Awake() {
        {
            std::lock_guard<std::mutex> lk(mu);
            stop = true;
        }
        cv.notify_all();
        for (auto& t : threads) t.join();
    }
    // A job started: spinners asleep wake (cheaply: one flag read when they are already spinning).
    void touch() {
        g_last_job_ns.store(now_ns_steady(), std::memory_order_relaxed);
        if (sleeping.load(std::memory_order_relaxed)) {
            { std::lock_guard<std::mutex> lk(mu); ++epoch; }
            cv.notify_all();
        }
    }
    void loop() {
        uint64_t seen = 0;
        auto window_ns = [] { return int64_t(g_awake_ms.load(std::memory_order_relaxed)) * 1000000; };
        for (;;) {
            while (now_ns_steady() - g_last_job_ns.load(std::memory_order_relaxed) < window_ns()) {
                for (int i = 0; i < 64; ++i) cpu_relax();
                // A woken thread does not always preempt an idle-class one at once (it waited for the
                // next tick, milliseconds, in the services here): hand the CPU over every few µs.
                sched_yield();
                if (stop) return;
            }
            std::unique_lock<std::mutex> lk(mu);
            sleeping.fetch_add(1);
            cv.wait(lk, [&] { return stop || epoch != seen; });
            sleeping.fetch_sub(1);
            seen = epoch;
            if (stop) return;
        }
    }
    std::vector<std::thread> threads;
    std::mutex mu;
    std::condition_variable cv;
    std::atomic<int> sleeping{0};
    uint64_t epoch = 0;
    std::atomic<bool> stop{false};
};

struct Pool {
    explicit Pool(int n) : n_workers(n - 1) {
        for (int i = 0; i < n_workers; ++i) threads.emplace_back([this, i] { loop(i + 1); });
        pin(g_worker_cpus);
    }

    // One spinner per thread of the pool, on that thread's CPU where they are pinned (none while
    // g_awake_ms is 0).
    void keep_awake(const std::vector<int>& pinned) {
        awake.reset();
        if (g_awake_ms.load() <= 0) return;
        std::vector<int> cpus;
        for (int i = 0; i <= n_workers; ++i) cpus.push_back(pinned.empty() ? -1 : pinned[size_t(i) % pinned.size()]);
        awake = std::make_unique<Awake>(cpus);
    }

    // Worker i (1..n_workers) to cpus[i % size]; the caller of parallel(), worker 0, pins itself.
    void pin(const std::vector<int>& cpus) {
        keep_awake(cpus);
        if (cpus.empty()) return;
        for (int i = 0; i < n_workers; ++i) pin_thread(threads[i], cpus[size_t(i + 1) % cpus.size()]);
    }
    ~Pool() {
        awake.reset();
        {
            std::lock_guard<std::mutex> lk(mu);
            stop = true;
            gen.fetch_add(1);
        }
        cv_work.notify_all();
        for (auto& t : threads) t.join();
    }

    void run(JobFn f, void* c) {
        if (awake && g_awake_ms.load(std::memory_order_relaxed)) awake->touch();  // none once parked
        fn = f;
        ctx = c;
        pending.store(n_workers, std::memory_order_relaxed);
        gen.fetch_add(1, std::memory_order_release);
        { std::lock_guard<std::mutex> lk(mu); }
        cv_work.notify_all();
        f(c, 0);
        if (!spin_until([&] { return pending.load(std::memory_order_acquire) == 0; })) {
            std::unique_lock<std::mutex> lk(mu);
            cv_done.wait(lk, [&] { return pending.load(std::memory_order_acquire) == 0; });
        }
    }

    template <class Pred>
    static bool spin_until(Pred p) {
        auto t0 = std::chrono::steady_clock::now();
        for (unsigned i = 1;; ++i) {
            if (p()) return true;
            cpu_relax();
            if ((i & 63) == 0 && std::chrono::steady_clock::now() - t0 > kSpin) return p();
        }
    }

    void loop(int tid) {
        uint64_t seen = 0;
        for (;;) {
            const uint64_t epoch = g_park_epoch.load(std::memory_order_relaxed);
            if (!spin_until([&] {
                    return gen.load(std::memory_order_acquire) != seen ||
                           g_park_epoch.load(std::memory_order_relaxed) != epoch;
                }) || gen.load(std::memory_order_acquire) == seen) {
                std::unique_lock<std::mutex> lk(mu);
                cv_work.wait(lk, [&] { return gen.load(std::memory_order_acquire) != seen; });
            }
            seen = gen.load(std::memory_order_acquire);
            if (stop) return;
            fn(ctx, tid);
            if (pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                { std::lock_guard<std::mutex> lk(mu); }
                cv_done.notify_one();
            }
        }
    }

    const int n_workers;
    std::unique_ptr<Awake> awake;  // null: g_awake_ms was 0 when the pool was made
    std::vector<std::thread> threads;
    std::mutex mu;
    std::condition_variable cv_work, cv_done;
    std::atomic<uint64_t> gen{0};
    std::atomic<int> pending{0};
    bool stop = false;
    JobFn fn = nullptr;
    void* ctx = nullptr;
};

std::mutex g_pool_mu;          // held while a job runs on the pool, and while it is rebuilt
Pool* g_pool = nullptr;
std::atomic<int> g_threads{1};
std::once_flag g_atfork_once;

void after_fork_child() {
    // The child has none of the parent's worker threads: forget the pool (leaked on purpose,
    // its threads do not exist here) and make a new one on first use.
    new (&g_pool_mu) std::mutex();
    g_pool = nullptr;
}

}  // namespace

int num_threads() { return g_threads.load(std::memory_order_relaxed); }

uint8_t* scratch(int slot, size_t n) {
    struct Slots {
        void* p[kScratchSlots] = {};
        size_t cap[kScratchSlots] = {};
        ~Slots() { for (void* q : p) std::free(q); }
    };
    thread_local Slots s;
    if (s.cap[slot] < n) {
        std::free(s.p[slot]);
        size_t cap = std::max<size_t>(n + n / 4, 4096);
        cap = (cap + 63) / 64 * 64;
        s.p[slot] = std::aligned_alloc(64, cap);
        s.cap[slot] = s.p[slot] ? cap : 0;
    }
    return static_cast<uint8_t*>(s.p[slot]);
}

void parallel(JobFn fn, void* ctx) {
    const int n = num_threads();
    if (n <= 1) {
        fn(ctx, 0);
        return;
    }
    std::unique_lock<std::mutex> lk(g_pool_mu, std::try_to_lock);
    if (!lk.owns_lock()) {  // another thread's job holds the pool: do this one alone
        fn(ctx, 0);
        return;
    }
    if (!g_pool || g_pool->n_workers != n - 1) {
        std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, after_fork_child); });
        delete g_pool;
        g_pool = new Pool(n);
    }
    g_pool->run(fn, ctx);
}

}  // namespace smk

using namespace smk;

// ---- C API ----------------------------------------------------------------------------------

SMK_API const char* smk_isa() { return kernels().name; }

// Lower the ISA for this process (tests and benchmarks compare the code paths). Returns 0, or
// -1 if the name is unknown or this CPU cannot run it.
SMK_API int smk_set_isa(const char* name) {
    kernels();
    for (int i = 0; i < 4; ++i)
        if (!std::strcmp(name, kIsaNames[i])) {
            if (i > g_best) return -1;
            g_isa.store(i);
            for (TypeChoice& c : g_choice) c = TypeChoice();  // a chosen ISA means its own kernels
            rebuild_mixed();
            return 0;
        }
    return -1;
}

// The VBMI grid decoder in the VNNI table (on: where the CPU has it; off: the per-row lookups).
// Returns 0, or -1 where this CPU has no VBMI kernel.
SMK_API int smk_set_vbmi(int on) {
    kernels();
    if (!g_iq_vbmi) return -1;
    g_tables[ISA_VNNI].dot[kVbmiType] = on ? g_iq_vbmi : g_iq_plain;
    rebuild_mixed();
    return 0;
}

// The calibration's choice for one type: the ISA whose kernels it runs (null or "": the table's
// own), and whether its weights are packed where that ISA packs them. Returns 0, or -1 for a type
// out of range or an ISA above the one in use.
SMK_API int smk_set_type_choice(int type, const char* isa, int pack) {
    kernels();
    if (type < 0 || type >= 64) return -1;
    const int i = (isa && *isa) ? isa_index(isa) : -1;
    if ((isa && *isa) && (i < 0 || i > g_isa.load())) return -1;
    g_choice[type].isa = i;
    g_choice[type].pack = pack != 0;
    rebuild_mixed();
    return 0;
}

// One ISA's kernel for a type (packed: its packed-weight kernel, only where packing pays there),
// as an address: the calibration tries only the ISAs whose kernel differs. 0: none.
SMK_API const void* smk_isa_kernel(const char* isa, int type, int packed) {
    kernels();
    const int i = isa_index(isa);
    if (i < 0 || i > g_best || type < 0 || type >= 64) return nullptr;
    const Kernels& K = g_tables[i];
    if (packed) return K.packed_fast[type] ? reinterpret_cast<const void*>(K.packed[type]) : nullptr;
    return reinterpret_cast<const void*>(K.dot[type]);
}

SMK_API const char* smk_best_isa() {
    kernels();
    return kIsaNames[g_best];
}

SMK_API void smk_set_num_threads(int n) {
    n = std::max(1, std::min(n, 1024));
    std::lock_guard<std::mutex> lk(g_pool_mu);
    g_threads.store(n);
    if (g_pool && g_pool->n_workers != n - 1) {
        delete g_pool;
        g_pool = nullptr;
    }
}

SMK_API int smk_get_num_threads() { return num_threads(); }

// How long after its last job the pool keeps its CPUs from halting (see Awake); 0: never.
SMK_API void smk_set_awake_ms(int ms) {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    g_awake_ms.store(std::max(0, ms));
    if (g_pool) g_pool->keep_awake(g_worker_cpus);
}

SMK_API int smk_get_awake_ms() { return g_awake_ms.load(); }

// The pool's idle workers stop spinning and sleep until the next job (see g_park_epoch).
// A process that parks hands its cores to another one at every hop (the services): its CPUs are
// that one's then, and its spinners stop for good. Idle priority is idle only within the process's
// scheduling group (autogroup: a session; or a container's cgroup), and each service has its own:
// against the other service a spinner competes at full weight (measured here: decode through the
// services 115 -> 92 tok/s, and a hop as long as the spinning window).
SMK_API void smk_park() {
    g_park_epoch.fetch_add(1, std::memory_order_relaxed);
    if (g_awake_ms.load(std::memory_order_relaxed)) g_awake_ms.store(0, std::memory_order_relaxed);
}

// Pin the pool's workers: worker i (1..threads-1) to cpus[i % n], now and in any pool made later;
// the threads that call into the pool pin themselves to cpus[0] (kernels.native.pin_compute).
// Where two processes share cores and take turns (the attention side and its expert services),
// each one's thread i on core i hands every core from one side's thread to the other's, with no
// migration between; measured here, 5-7% faster decode through the services. n = 0: unpinned
// from now on (threads already pinned stay so).
SMK_API void smk_pin_workers(const int* cpus, int n) {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    g_worker_cpus.assign(cpus, cpus + std::max(0, n));
    if (g_pool) g_pool->pin(g_worker_cpus);
}

SMK_API int smk_supports(int type) { return type >= 0 && type < 64 && kernels().dot[type] != nullptr; }

SMK_API size_t smk_act_bytes(int k) { return act_bytes(k); }

namespace {

// Rows of several weights against the same quantized activations, as one work list: item i covers
// rows [r0, r1) of weight w, written to out[t * ostride + col[w] + r].
struct MatmulItem { int w, r0, r1; };

struct MatmulJob {
    const DotRowsFn* dot;
    const uint8_t* const* w;
    const size_t* wstride;
    const int* col;
    int k, m;
    const Act* acts;
    float* out;
    size_t ostride;
    std::vector<MatmulItem> items;
    std::atomic<int> next{0};
};

void run_items(MatmulJob* j, int i0, int i1) {
    for (int i = i0; i < i1; ++i) {
        const MatmulItem& it = j->items[i];
        j->dot[it.w](j->w[it.w], j->wstride[it.w], it.r0, it.r1, j->k, j->acts, j->m,
                     j->out + j->col[it.w] + it.r0, j->ostride);
    }
}

void matmul_job(void* p, int) {
    auto* j = static_cast<MatmulJob*>(p);
    for (;;) {
        const int i = j->next.fetch_add(1, std::memory_order_relaxed);
        if (i >= int(j->items.size())) return;
        run_items(j, i, i + 1);
    }
}

struct QuantJob {
    QuantizeFn q;
    const float* x;
    size_t xstride;
    int n, k;
    uint8_t* rec;
    std::atomic<int> next{0};
};

void quant_job(void* p, int) {
    auto* j = static_cast<QuantJob*>(p);
    const int step = 4;
    for (;;) {
        int i0 = j->next.fetch_add(step, std::memory_order_relaxed);
        if (i0 >= j->n) return;
        int i1 = std::min(j->n, i0 + step);
        j->q(j->x + size_t(i0) * j->xstride, j->xstride, i1 - i0, j->k, j->rec + size_t(i0) * act_bytes(j->k));
    }
}


}  // namespace

namespace smk {
// Quantize n rows (possibly in parallel) into rec.
void quantize_rows(const float* x, size_t xstride, int n, int k, uint8_t* rec) {
    const Kernels& K = kernels();
    if (size_t(n) * size_t(k) < (size_t(1) << 16) || num_threads() == 1) {
        K.quantize(x, xstride, n, k, rec);
        return;
    }
    QuantJob j;
    j.q = K.quantize; j.x = x; j.xstride = xstride; j.n = n; j.k = k; j.rec = rec;
    parallel(quant_job, &j);
}
}  // namespace smk

namespace {
// Whether `rows` rows of k values of `type` (kPackedBit: packed by 16 rows, wstride a group's) fit the
// row stride: whole blocks, whole groups, no overlap.
bool rows_fit(int type, int rows, int k, size_t wstride) {
    if (rows < 0 || k <= 0) return false;
    if (type & kPackedBit) {
        const int unit = packed_unit(type & 63);
        return rows % kPackRows == 0 && k % unit == 0 && wstride >= size_t(k / unit) * packed_bytes(type & 63);
    }
    const TypeInfo ti = type_info(type);
    return ti.elems > 0 && k % ti.elems == 0 && wstride >= size_t(k / ti.elems) * ti.bytes;
}
}  // namespace

// For each weight i of n_w (GGML type types[i], rows ns[i] of k values at ws[i], row stride
// wstrides[i] bytes): out[t, col_i + r] = x[t] . dequantize(row r), where col_i is the sum of the
// earlier weights' rows and a row of `out` is ostride floats. The activations are quantized once
// for all the weights (a layer's q, k and v; gate and up). Returns 0, or a negative error code
// (the Python side validated the arguments already; this is the last line of defence).
namespace {
int matmul_multi(int n_w, const int* types, const uint8_t* const* ws, const size_t* wstrides, const int* ns, int k,
                 const float* x, size_t xstride, int m, float* out, size_t ostride, bool residual) {
    const Kernels& K = kernels();
    if (n_w <= 0 || n_w > 16 || k <= 0 || m < 0) return -2;
    DotRowsFn dot[16];
    int col[16];
    int total = 0;
    for (int i = 0; i < n_w; ++i) {
        const int type = types[i];
        dot[i] = dot_for(K, type);
        if (!dot[i]) return -1;
        if (!rows_fit(type, ns[i], k, wstrides[i])) return -2;
        col[i] = total;
        total += ns[i];
    }
    if (ostride < size_t(total)) return -2;
    if (total == 0 || m == 0) return 0;
    const size_t rb = act_bytes(k);
    const int rows = residual ? 2 * m : m;  // residual: x's rows, then what their rounding left out
    uint8_t* buf = scratch(0, rb * size_t(rows) + sizeof(Act) * size_t(rows));
    if (!buf) return -3;
    quantize_rows(x, xstride, m, k, buf);
    Act* acts = reinterpret_cast<Act*>(buf + rb * size_t(rows));
    for (int t = 0; t < m; ++t) acts[t] = act_at(buf + rb * size_t(t), k);
    float* y = out;
    size_t ystride = ostride;
    if (residual) {
        float* r = reinterpret_cast<float*>(scratch(8, sizeof(float) * size_t(m) * size_t(k)));
        y = reinterpret_cast<float*>(scratch(9, sizeof(float) * size_t(rows) * size_t(total)));
        if (!r || !y) return -3;
        ystride = size_t(total);
        for (int t = 0; t < m; ++t) {
            const float* xt = x + size_t(t) * xstride;
            float* rt = r + size_t(t) * k;
            for (int b = 0; b < k / 32; ++b) {  // rows_fit: k is whole blocks of 32 (or 256)
                const float d = acts[t].d[b];
                for (int i = 32 * b; i < 32 * b + 32; ++i) rt[i] = xt[i] - float(acts[t].q[i]) * d;
            }
        }
        quantize_rows(r, size_t(k), m, k, buf + rb * size_t(m));
        for (int t = m; t < rows; ++t) acts[t] = act_at(buf + rb * size_t(t), k);
    }
    MatmulJob j;
    j.dot = dot; j.w = ws; j.wstride = wstrides; j.col = col; j.k = k; j.m = rows; j.acts = acts;
    j.out = y; j.ostride = ystride;
    // Chunks of rows small enough to balance (about 8 per thread over all the weights) and to keep
    // the per-row writes of neighbouring threads apart.
    const int nt = num_threads();
    int chunk = std::max(16, (total + nt * 8 - 1) / (nt * 8));
    chunk = (chunk + 15) / 16 * 16;
    for (int i = 0; i < n_w; ++i)
        for (int r0 = 0; r0 < ns[i]; r0 += chunk) j.items.push_back({i, r0, std::min(ns[i], r0 + chunk)});
    if (nt == 1 || j.items.size() == 1) {
        run_items(&j, 0, int(j.items.size()));
    } else {
        parallel(matmul_job, &j);
    }
    if (residual)
        for (int t = 0; t < m; ++t) {
            const float* a = y + size_t(t) * ystride;
            const float* b = y + size_t(m + t) * ystride;
            float* o = out + size_t(t) * ostride;
            for (int c = 0; c < total; ++c) o[c] = a[c] + b[c];
        }
    return 0;
}
}  // namespace

SMK_API int smk_matmul_multi(int n_w, const int* types, const uint8_t* const* ws, const size_t* wstrides,
                             const int* ns, int k, const float* x, size_t xstride, int m, float* out, size_t ostride) {
    return matmul_multi(n_w, types, ws, wstrides, ns, k, x, xstride, m, out, ostride, false);
}

// smk_matmul_multi with the activations in two int8 terms: each row as smk_matmul_multi quantizes it,
// plus what that rounding left out (x minus its dequantized blocks, at most half a step of the block's
// scale), quantized the same way; out is the sum of both products. The product's activation error falls
// from ~1/254 of each block's largest value to ~1/254 of that. The attention projections use it: their
// int8 rounding is what moved the decode path's logits further from the exact reference than the prompt
// path's (which multiplies in bfloat16), flipping routing near-ties llama.cpp's own decode does not flip
// (tests/attention_service/model/test_decode_fidelity.py). The second term rides in the same tiles:
// measured in the 6-layer Qwen3-30B-A3B shape's attention front on Zen 5, ~2% at 1 row (the weights'
// bytes bound it), +25% at 4, +40% at 8 and +60% at 16 (the tiles turn compute-bound), so callers use it
// for steps of one sequence (a decode token, a stream's verification rows) and not for batched streams.
SMK_API int smk_matmul_multi_residual(int n_w, const int* types, const uint8_t* const* ws, const size_t* wstrides,
                                      const int* ns, int k, const float* x, size_t xstride, int m, float* out,
                                      size_t ostride) {
    return matmul_multi(n_w, types, ws, wstrides, ns, k, x, xstride, m, out, ostride, true);
}

namespace {
// smk_matmul_heads' work list: item i is head i / per, rows [r0, r1) of it.
struct HeadsJob {
    DotRowsFn dot;
    const uint8_t* w;
    size_t head_bytes, wstride;
    int rows, k, m, per, chunk, items;
    const Act* acts;
    float* out;
    std::atomic<int> next{0};
};

void heads_job(void* p, int) {
    auto* j = static_cast<HeadsJob*>(p);
    for (;;) {
        const int i = j->next.fetch_add(1, std::memory_order_relaxed);
        if (i >= j->items) return;
        const int h = i / j->per, r0 = (i % j->per) * j->chunk, r1 = std::min(j->rows, r0 + j->chunk);
        j->dot(j->w + size_t(h) * j->head_bytes, j->wstride, r0, r1, j->k, j->acts + size_t(h) * j->m, j->m,
               j->out + size_t(h) * j->m * j->rows + r0, size_t(j->rows));
    }
}
}  // namespace

// Per-head maps (MLA's attn_k_b and attn_v_b): `heads` weights of `rows` rows of k values (GGML type
// `type`, head h at w + h * head_bytes, row stride wstride; with kPackedBit each head packed by 16 rows,
// wstride a group's), each against its own m activation rows:
// out[h, t, r] = x[h, t] . dequantize(w[h] row r); x is [heads, m, k] and out [heads, m, rows], float32.
// The heads' activations are quantized in one pass and the heads shared out over the pool: torch's
// batched product over the dense copies read twice the bytes on one thread. Returns 0 or a negative code.
SMK_API int smk_matmul_heads(int type, const uint8_t* w, size_t head_bytes, size_t wstride, int rows, int k,
                             const float* x, int heads, int m, float* out) {
    const Kernels& K = kernels();
    const DotRowsFn dot = dot_for(K, type);
    if (!dot) return -1;
    const bool packed = type & kPackedBit;
    if (heads < 0 || m < 0 || !rows_fit(type, rows, k, wstride) ||
        head_bytes < wstride * size_t(packed ? rows / kPackRows : rows))
        return -2;
    if (heads == 0 || rows == 0 || m == 0) return 0;
    const size_t rb = act_bytes(k), n = size_t(heads) * size_t(m);
    uint8_t* buf = scratch(0, rb * n + sizeof(Act) * n);
    if (!buf) return -3;
    quantize_rows(x, size_t(k), int(n), k, buf);
    Act* acts = reinterpret_cast<Act*>(buf + rb * n);
    for (size_t t = 0; t < n; ++t) acts[t] = act_at(buf + rb * t, k);
    HeadsJob j;
    j.dot = dot; j.w = w; j.head_bytes = head_bytes; j.wstride = wstride; j.rows = rows; j.k = k; j.m = m;
    j.acts = acts; j.out = out;
    // a head a work item, split in row chunks only where there are fewer heads than ~8 per thread
    const int nt = num_threads();
    j.per = std::max(1, std::min(rows / 16, (nt * 8 + heads - 1) / heads));
    j.chunk = (rows + j.per - 1) / j.per;
    if (packed) j.chunk = (j.chunk + kPackRows - 1) / kPackRows * kPackRows;  // whole groups
    j.per = (rows + j.chunk - 1) / j.chunk;
    j.items = heads * j.per;
    if (nt == 1) heads_job(&j, 0);
    else parallel(heads_job, &j);
    return 0;
}
