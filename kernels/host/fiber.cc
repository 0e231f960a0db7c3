// The emulator's scheduler: a block's threads as fibers on one OS thread (cuda_emu.h), blocks
// spread over a few OS threads. A fiber runs until it waits at a barrier (the block's, or its
// warp's for shuffles and __syncwarp) or returns; the scheduler resumes the fibers in turn, and a
// barrier lets its fibers on once all of its group that are still running have arrived.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "launch.h"

namespace tandem_emu {

thread_local uint3 g_block_idx;
thread_local dim3 g_block_dim;
thread_local dim3 g_grid_dim;

namespace {

// Bytes of stack per fiber (a guard page below each).
constexpr size_t STACK_BYTES = 256 << 10;
constexpr unsigned WARP = 32;

struct Barrier {
    unsigned live = 0;
    unsigned arrived = 0;
    unsigned gen = 0;
};

struct Fiber {
    void* sp = nullptr;
    uint3 tid{0, 0, 0};
    unsigned lane = 0;
    unsigned warp = 0;
    bool done = false;
    char* stack = nullptr; // lowest address of the mapping (the guard page)
};

struct Block {
    std::vector<Fiber> fibers;
    Barrier block;
    std::vector<Barrier> warps;
    std::vector<uint64_t> slots; // WARP per warp
    std::vector<unsigned> warp_sizes;
    const std::function<void()>* body = nullptr;
    void* sched_sp = nullptr;
};

thread_local Block* t_block = nullptr;
thread_local Fiber* t_fiber = nullptr;

} // namespace

} // namespace tandem_emu

extern "C" void tandem_emu_switch(void** save, void* to);

// Saves the callee-saved registers and the stack pointer of the running context in *save, and
// resumes the context whose stack pointer is `to` (x86-64 System V).
__asm__(R"(
    .text
    .p2align 4
    .globl tandem_emu_switch
    .hidden tandem_emu_switch
    .type tandem_emu_switch,@function
tandem_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tandem_emu_switch,.-tandem_emu_switch
)");

namespace tandem_emu {
namespace {

void fail(const char* what) {
    fprintf(stderr, "tandem kernel emulator: %s\n", what);
    abort();
}

void yield() {
    tandem_emu_switch(&t_fiber->sp, t_block->sched_sp);
}

void leave(Barrier& b) {
    b.live -= 1;
    if (b.live > 0 && b.arrived == b.live) {
        b.arrived = 0;
        b.gen += 1;
    }
}

void wait_at(Barrier& b) {
    const unsigned gen = b.gen;
    if (++b.arrived == b.live) {
        b.arrived = 0;
        b.gen += 1;
        return;
    }
    do {
        yield();
    } while (b.gen == gen);
}

// Where a fiber starts (entered by `ret` from tandem_emu_switch, never returns).
void fiber_main() {
    Block* b = t_block;
    Fiber* f = t_fiber;
    (*b->body)();
    f->done = true;
    leave(b->block);
    leave(b->warps[f->warp]);
    tandem_emu_switch(&f->sp, b->sched_sp);
    fail("a finished fiber was resumed");
}

// A stack for a fiber that starts in fiber_main: six zeroed registers, then fiber_main's address
// for `ret`, so that it begins with the stack 16-byte aligned as after a call.
void* fresh_stack(char* stack) {
    char* top = stack + STACK_BYTES + 4096;
    void** sp = reinterpret_cast<void**>(top - 64);
    for (int i = 0; i < 6; ++i) {
        sp[i] = nullptr;
    }
    sp[6] = reinterpret_cast<void*>(&fiber_main);
    sp[7] = nullptr;
    return sp;
}

char* map_stack() {
    const size_t bytes = STACK_BYTES + 4096;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        fail("cannot map a fiber stack");
    }
    mprotect(p, 4096, PROT_NONE);
    return static_cast<char*>(p);
}

struct Stacks {
    std::vector<char*> all;
    ~Stacks() {
        for (char* s : all) {
            munmap(s, STACK_BYTES + 4096);
        }
    }
};

thread_local Stacks t_stacks;

void run_block(Block& b, dim3 bd) {
    const unsigned n = bd.x * bd.y * bd.z;
    if (n == 0 || n > 1024) {
        fail("a block of more than 1024 threads");
    }
    while (t_stacks.all.size() < n) {
        t_stacks.all.push_back(map_stack());
    }
    const unsigned n_warps = (n + WARP - 1) / WARP;
    b.fibers.assign(n, Fiber{});
    b.warps.assign(n_warps, Barrier{});
    b.warp_sizes.assign(n_warps, 0);
    b.slots.assign((size_t)n_warps * WARP, 0);
    b.block = Barrier{};
    b.block.live = n;
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = b.fibers[i];
        f.tid = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
        f.lane = i % WARP;
        f.warp = i / WARP;
        f.stack = t_stacks.all[i];
        f.sp = fresh_stack(f.stack);
        b.warps[f.warp].live += 1;
        b.warp_sizes[f.warp] += 1;
    }
    unsigned running = n;
    while (running > 0) {
        for (unsigned i = 0; i < n; ++i) {
            Fiber& f = b.fibers[i];
            if (f.done) {
                continue;
            }
            t_fiber = &f;
            tandem_emu_switch(&b.sched_sp, f.sp);
            if (f.done) {
                running -= 1;
            }
        }
    }
    t_fiber = nullptr;
}

unsigned os_threads() {
    if (const char* v = getenv("TANDEM_EMU_THREADS")) {
        const int n = atoi(v);
        if (n > 0) {
            return (unsigned)n;
        }
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : hw;
}

} // namespace

const uint3& thread_idx() {
    return t_fiber->tid;
}

unsigned lane() {
    return t_fiber->lane;
}

unsigned warp_size() {
    return t_block->warp_sizes[t_fiber->warp];
}

uint64_t* warp_slots() {
    return t_block->slots.data() + (size_t)t_fiber->warp * WARP;
}

void sync_block() {
    wait_at(t_block->block);
}

void sync_warp() {
    wait_at(t_block->warps[t_fiber->warp]);
}

void run(dim3 grid, dim3 block, const std::function<void()>& body) {
    const size_t n_blocks = (size_t)grid.x * grid.y * grid.z;
    if (n_blocks == 0) {
        return;
    }
    const unsigned n_threads = (unsigned)std::min<size_t>(os_threads(), n_blocks);
    std::atomic<size_t> next{0};
    auto work = [&] {
        Block b;
        b.body = &body;
        t_block = &b;
        g_grid_dim = grid;
        g_block_dim = block;
        for (size_t i = next.fetch_add(1); i < n_blocks; i = next.fetch_add(1)) {
            g_block_idx = uint3{(unsigned)(i % grid.x), (unsigned)((i / grid.x) % grid.y), (unsigned)(i / ((size_t)grid.x * grid.y))};
            run_block(b, block);
        }
        t_block = nullptr;
    };
    if (n_threads <= 1) {
        work();
        return;
    }
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < n_threads; ++t) {
        pool.emplace_back(work);
    }
    work();
    for (auto& t : pool) {
        t.join();
    }
}

} // namespace tandem_emu
