// flashgen: the per-kernel cache of a launcher's TMA tensor maps (sm_90a families).
//
// Glossary
//   Key    what a call's maps depend on (addresses, sizes, strides): a struct without padding,
//          compared bytewise
//   Maps   the kernel's __grid_constant__ bundle of tensor maps
// A training loop or a decode server repeats its shapes and buffers, and an encode costs
// microseconds: the last kSlots calls' maps are kept, a mutex guards them.
#pragma once

#include <string.h>

#include <mutex>

namespace fg {
namespace sm90 {

template <class Key, class Maps, int kSlots = 8>
class MapCache {
 public:
  // Copies the maps of `key` into *out when cached.
  bool find(const Key& key, Maps* out) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < used_; ++i)
      if (memcmp(&keys_[i], &key, sizeof key) == 0) {
        *out = maps_[i];
        return true;
      }
    return false;
  }
  void put(const Key& key, const Maps& maps) {
    std::lock_guard<std::mutex> lock(mu_);
    keys_[next_] = key;
    maps_[next_] = maps;
    next_ = (next_ + 1) % kSlots;
    if (used_ < kSlots) ++used_;
  }

 private:
  std::mutex mu_;
  Key keys_[kSlots];
  Maps maps_[kSlots];
  int used_ = 0, next_ = 0;
};

}  // namespace sm90
}  // namespace fg
