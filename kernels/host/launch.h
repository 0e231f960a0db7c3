// Host launches of emulated kernels: an entry point per kernel that takes the grid, the block and
// the arguments as cuLaunchKernel takes them (an array of pointers to each argument's value), so
// the runtime launches an emulated kernel exactly as it launches a real one.
#pragma once

#include <functional>
#include <utility>

#include "cuda_emu.h"

namespace tandem_emu {

// Runs `body` once per thread of every block of `grid` (fiber.cc).
void run(dim3 grid, dim3 block, const std::function<void()>& body);

template <typename... A, size_t... I>
inline void invoke_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
}

template <typename... A>
inline void invoke(void (*f)(A...), void** args) {
    invoke_impl(f, args, std::index_sequence_for<A...>{});
}

// The entry point of kernel `F`: grid and block as three unsigned each.
template <auto F>
void entry(const unsigned* grid, const unsigned* block, void** args) {
    run(dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), [args] { invoke(F, args); });
}

} // namespace tandem_emu

extern "C" {
typedef void (*tandem_emu_entry)(const unsigned* grid, const unsigned* block, void** args);
typedef void (*tandem_emu_register)(void* ctx, const char* name, tandem_emu_entry entry);
}
