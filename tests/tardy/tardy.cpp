// tardy: a PrivateUse1 accelerator on the CPU whose copies land late, for torchsurgery's tests.
//
// What it is (tests/tardy/__init__.py builds it, names it "tardy" and registers it):
//
// * Device memory: host memory from malloc, reachable only through the device (CPU kernels
//   refuse its tensors), counted against a capacity; an allocation beyond it raises
//   torch.OutOfMemoryError. Fresh memory holds poison (0xFF bytes: NaN in every floating
//   dtype). Statistics as torch.accelerator reads them (allocated, reserved, peaks, free).
// * Streams: the default stream (0) and a pool of side streams, each a queue of copies,
//   event records and event waits run in order. A worker thread per stream runs its queue
//   late: a copy's destination is poisoned as soon as the copy may start, and the bytes land
//   after a random delay. In lazy mode workers do nothing: work runs only when someone
//   waits for it (the host, or a stream waiting on an event), on the waiting thread.
// * Copies: from pinned host memory the source is read when the copy lands; from pageable
//   memory it is read at the call (as CUDA stages it) and the destination still lands late;
//   into pinned host memory they land late, into pageable memory before the call returns.
// * Compute: every other operator runs through a boxed fallback, on the calling thread, as
//   the CPU kernel on CPU views of the same memory, after the current stream's queue has
//   run: compute is the stream's next work item, so waiting on an event orders it.
// * Hazards: every use of device memory is stamped with its stream's position, and every
//   stream carries a vector clock of what it is ordered after (by event waits and by host
//   synchronisation, never by timing). A copy or kernel that touches memory another stream
//   wrote (or a write to memory another stream used) without an event in between raises at
//   once; memory freed while another stream's use of it is unordered with its allocation
//   stream is reported at the next call into the device (torch.ops.tardy.hazards()).
// * A copy log, while the tests ask for it: each copy's stream, whether the call returned
//   before the copy ran, and (when read) whether it has landed, so that tests can see where
//   copies run and what they may overlap without timing anything.
//
// Only documented extension points are used: c10::DeviceAllocator, the DeviceGuardImpl
// registry, at::PrivateUse1HooksInterface, TORCH_LIBRARY_IMPL kernels and a boxed fallback.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/InferenceMode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
constexpr int kStreams = 9;  // stream 0 is the default stream, 1..8 the side-stream pool
constexpr unsigned char kPoison = 0xFF;
constexpr size_t kAlign = 64;

using Clock = std::array<int64_t, kStreams>;  // per stream: how many of its items are ordered before
using Uses = std::array<int64_t, kStreams>;  // per stream: the position of the last use, -1: none

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void merge(Clock& into, const Clock& from) {
  for (int s = 0; s < kStreams; ++s) into[s] = std::max(into[s], from[s]);
}

// ------------------------------------------------------------------ state

struct Block {  // one device allocation
  void* ptr = nullptr;
  size_t size = 0;
  int stream = 0;  // the stream current when it was allocated
  int pending = 0;  // queued copies that touch it
  bool released = false;  // its storage let go of it; freed once nothing is pending
  uint32_t recorded = 0;  // streams given to record_stream (bit per stream)
  Uses read{};
  Uses write{};
  Block() {
    read.fill(-1);
    write.fill(-1);
  }
};

struct Mark {  // one recording of an event: done once its stream's queue reached it
  int stream = 0;
  int64_t index = 0;
  Clock clock{};
  bool done = false;
  double at = 0.0;
};

struct EventHandle {
  std::shared_ptr<Mark> mark;  // the latest recording; waits hold the one current at their call
  bool timing = false;
};

struct Item {
  enum Kind { kCopy, kRecord, kWait } kind = kRecord;
  int64_t index = 0;
  at::Tensor dst, src;  // CPU tensors: views of device memory, pinned host tensors, snapshots
  std::vector<Block*> blocks;  // device memory the copy touches
  bool poisoned = false;
  std::chrono::steady_clock::time_point due{};
  std::shared_ptr<Mark> mark;
};

struct CopyNote {  // one logged copy
  int stream = 0;
  int64_t index = 0;  // its position in the stream's queue
  bool asynchronous = false;  // the call returned before the copy ran
  bool to_device = false;
  int64_t nbytes = 0;
};

struct Stream {
  std::deque<Item> items;  // items[0] has position `completed`
  int64_t enqueued = 0;
  int64_t completed = 0;
  bool busy = false;  // a thread is running (or poisoning for) items[0]
  bool worker = false;
  Clock clock{};
};

struct State {
  std::mutex mutex;
  std::condition_variable changed;
  Stream streams[kStreams];
  Clock host{};  // what the host has synchronised with
  int next_side = 0;
  // settings
  int64_t capacity = int64_t(24) << 30;  // tests/tardy/__init__.py configures it
  double delay_low = 0.0;
  double delay_high = 0.001;
  bool lazy = false;
  std::mt19937_64 rng{0};
  // memory
  c10::CachingDeviceAllocator::DeviceStats stats;
  int64_t reserved = 0;
  std::unordered_set<const void*> pinned;
  // finished work, let go of by the next call into the device (see run_front)
  std::vector<Item> graveyard;
  // what the tests read
  std::vector<std::string> hazards;
  int64_t copies = 0;
  int64_t pageable_copies = 0;
  bool logging = false;
  std::vector<CopyNote> copy_log;  // while logging: every copy issued, in issue order
};

State& state() {
  static State* s = new State();  // never destroyed: detached workers may outlive main()
  return *s;
}

thread_local int tls_stream = 0;

using Lock = std::unique_lock<std::mutex>;

// ------------------------------------------------------------------ running queued work

void destroy(State& st, Block* b) {
  std::free(b->ptr);
  st.reserved -= int64_t(b->size);
  auto& r = st.stats.reserved_bytes[0];
  r.decrease(b->size);
  st.stats.segment[0].decrease(1);
  st.stats.num_device_free += 1;
  delete b;
}

void poison(const at::Tensor& t) {
  if (t.numel() == 0) return;
  if (t.is_contiguous()) {
    std::memset(t.data_ptr(), kPoison, t.nbytes());
    return;
  }
  // every byte of every element, whatever the strides
  auto item = int64_t(t.element_size());
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  std::vector<int64_t> strides;
  for (auto s : t.strides()) strides.push_back(s * item);
  sizes.push_back(item);
  strides.push_back(1);
  at::from_blob(t.data_ptr(), sizes, strides, [](void*) {}, at::TensorOptions().dtype(at::kByte)).fill_(kPoison);
}

void run_until(State& st, int sid, int64_t target, Lock& lock);

// Runs items[0] of stream `sid` on this thread (the caller checked it exists and is not busy).
void run_front(State& st, int sid, Lock& lock) {
  Stream& s = st.streams[sid];
  s.busy = true;
  Item& item = s.items.front();  // deque references survive push_back
  if (item.kind == Item::kRecord) {
    item.mark->done = true;
    item.mark->at = now_seconds();
  } else if (item.kind == Item::kWait) {
    run_until(st, item.mark->stream, item.mark->index + 1, lock);
  } else {
    lock.unlock();
    std::string error;
    try {
      // bytes moving, as a DMA moves them: the call bumped the destination's version already,
      // and this thread (a worker, or whichever thread waits) need not share the caller's
      // inference mode, so the copy runs below autograd and the version counters
      at::AutoDispatchBelowADInplaceOrView raw;
      item.dst.copy_(item.src);
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    if (!error.empty()) st.hazards.push_back("tardy: a queued copy failed: " + error.substr(0, 300));
    for (Block* b : item.blocks) {
      if (--b->pending == 0 && b->released) destroy(st, b);
    }
  }
  Item finished = std::move(item);
  s.items.pop_front();
  s.completed += 1;
  s.busy = false;
  st.changed.notify_all();
  // a host tensor's last reference may be its Python object's, whose release takes the GIL,
  // which a thread waiting for this one may hold: the next call into the device lets go of it
  st.graveyard.push_back(std::move(finished));
}

// Lets go of finished work (called without the lock, from a call into the device).
void bury(State& st) {
  std::vector<Item> dead;
  {
    Lock lock(st.mutex);
    dead.swap(st.graveyard);
  }
}

// Declared before a call's lock: on the way in and out of the call (after the lock is let
// go), finished work is let go of, so a finished copy holds no tensor longer than on CUDA.
struct Burial {
  Burial() {
    bury(state());
  }
  ~Burial() {
    bury(state());
  }
};

// Blocks until stream `sid` has run its first `target` items, running them on this thread
// where no other thread is at them: a wait is what makes lazy work run. A copy that has
// started (its destination poisoned) lands at its due time, not earlier.
void run_until(State& st, int sid, int64_t target, Lock& lock) {
  Stream& s = st.streams[sid];
  while (s.completed < target) {
    if (s.busy || s.items.empty()) {
      st.changed.wait(lock);
    } else if (s.items.front().poisoned && std::chrono::steady_clock::now() < s.items.front().due) {
      st.changed.wait_until(lock, s.items.front().due);  // a copy under way takes its time
    } else {
      run_front(st, sid, lock);
    }
  }
}

// A stream's worker: runs the queue late (random delays), and not at all in lazy mode.
void work(int sid) {
  State& st = state();
  Lock lock(st.mutex);
  Stream& s = st.streams[sid];
  for (;;) {
    st.changed.wait(lock, [&] { return !st.lazy && !s.busy && !s.items.empty(); });
    Item& item = s.items.front();
    if (item.kind == Item::kCopy && !item.poisoned) {
      // the copy may start now: until it lands, its destination holds poison
      s.busy = true;
      std::uniform_real_distribution<double> delay(st.delay_low, st.delay_high);
      lock.unlock();
      poison(item.dst);
      lock.lock();
      item.poisoned = true;
      item.due = std::chrono::steady_clock::now() +
          std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(delay(st.rng)));
      s.busy = false;
      st.changed.notify_all();
      continue;
    }
    if (item.kind == Item::kCopy && std::chrono::steady_clock::now() < item.due) {
      st.changed.wait_until(lock, item.due);
      continue;  // it may have been run by a thread waiting for it meanwhile
    }
    run_front(st, sid, lock);
  }
}

Stream& admit(State& st, int sid) {
  Stream& s = st.streams[sid];
  merge(s.clock, st.host);  // what the host has seen complete precedes anything it issues
  return s;
}

int64_t enqueue(State& st, int sid, Item&& item) {
  Stream& s = admit(st, sid);
  item.index = s.enqueued++;
  int64_t index = item.index;
  s.items.push_back(std::move(item));
  if (!s.worker) {
    s.worker = true;
    std::thread(work, sid).detach();
  }
  st.changed.notify_all();
  return index;
}

// The host waited for the first `upto` items of stream `sid`.
void host_saw(State& st, int sid, int64_t upto) {
  merge(st.host, st.streams[sid].clock);
  st.host[sid] = std::max(st.host[sid], upto);
}

void host_saw(State& st, const Mark& mark) {
  merge(st.host, mark.clock);
}

void synchronize_all(State& st, Lock& lock) {
  for (int sid = 0; sid < kStreams; ++sid) {
    int64_t target = st.streams[sid].enqueued;
    run_until(st, sid, target, lock);
    host_saw(st, sid, target);
  }
}

void raise_hazards(State& st) {
  if (st.hazards.empty()) return;
  std::string message = st.hazards.front();
  if (st.hazards.size() > 1) message += " (and " + std::to_string(st.hazards.size() - 1) + " more)";
  st.hazards.clear();
  TORCH_CHECK(false, message);
}

// ------------------------------------------------------------------ hazards

const char* kFix =
    ": on an accelerator the two may overlap; record an event after the first and make the second's stream "
    "wait on it (Stream.wait_event), or synchronize in between";

std::string describe(const Block* b) {
  std::ostringstream out;
  out << b->size << " bytes of device memory allocated on stream " << b->stream;
  return out.str();
}

// `what` on stream `sid` reads (or writes) `b`: refuse it when another stream's conflicting
// use is not ordered before it.
void check_use(State& st, const Block* b, int sid, bool writes, const std::string& what) {
  const Clock& clock = st.streams[sid].clock;
  for (int other = 0; other < kStreams; ++other) {
    if (other == sid) continue;
    int64_t wrote = b->write[other];
    int64_t used = writes ? std::max(wrote, b->read[other]) : wrote;
    if (used >= 0 && clock[other] <= used) {
      std::ostringstream out;
      out << "tardy: hazard: " << what << " on stream " << sid << (writes ? " writes " : " reads ") << describe(b)
          << " that stream " << other << (wrote == used ? " wrote" : " read") << " without an event in between" << kFix;
      TORCH_CHECK(false, out.str());
    }
  }
}

void note_use(Block* b, int sid, int64_t position, bool writes) {
  (writes ? b->write : b->read)[sid] = position;
}

// ------------------------------------------------------------------ memory

void release_block(void* context);

Block* block_of(const c10::Storage& storage) {
  const auto& ptr = storage.data_ptr();
  return ptr.get_deleter() == &release_block ? static_cast<Block*>(ptr.get_context()) : nullptr;
}

void release_block(void* context) {
  State& st = state();
  Lock lock(st.mutex);
  auto* b = static_cast<Block*>(context);
  st.stats.allocated_bytes[0].decrease(b->size);
  st.stats.active_bytes[0].decrease(b->size);
  st.stats.allocation[0].decrease(1);
  st.stats.active[0].decrease(1);
  // the allocation stream may reuse the memory at once: every other stream's use of it
  // must be ordered before that stream's next work (or the stream given to record_stream)
  Clock clock = st.streams[b->stream].clock;
  merge(clock, st.host);
  for (int other = 0; other < kStreams; ++other) {
    int64_t used = std::max(b->read[other], b->write[other]);
    if (other == b->stream || (b->recorded >> other & 1u) || used < 0 || clock[other] > used) continue;
    std::ostringstream out;
    out << "tardy: hazard: " << describe(b) << " was freed while its use on stream " << other
        << " was not ordered before stream " << b->stream
        << ", which may reuse it at once: synchronize (or wait on an event after that use) before letting go of it";
    st.hazards.push_back(out.str());
    break;
  }
  b->released = true;
  if (b->pending == 0) destroy(st, b);
}

struct DeviceMemory final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    c10::Device device(kType, 0);
    if (n == 0) return {nullptr, nullptr, &release_nothing, device};
    State& st = state();
    Block* b = nullptr;
    {
      Lock lock(st.mutex);
      raise_hazards(st);
      if (st.reserved + int64_t(n) > st.capacity) {
        st.stats.num_ooms += 1;
        TORCH_CHECK_WITH(OutOfMemoryError, false,
            "tardy: out of memory: tried to allocate ", n, " bytes on tardy:0, which holds ", st.reserved,
            " bytes and has ", st.capacity - st.reserved, " free of its capacity of ", st.capacity,
            " bytes (torch.tardy.configure(capacity=...) sets it)");
      }
      b = new Block();
      b->size = n;
      b->stream = tls_stream;
      st.reserved += int64_t(n);
      st.stats.allocated_bytes[0].increase(n);
      st.stats.active_bytes[0].increase(n);
      st.stats.reserved_bytes[0].increase(n);
      st.stats.requested_bytes[0].increase(n);
      st.stats.allocation[0].increase(1);
      st.stats.active[0].increase(1);
      st.stats.segment[0].increase(1);
      st.stats.num_device_alloc += 1;
    }
    size_t rounded = (n + kAlign - 1) / kAlign * kAlign;
    b->ptr = std::aligned_alloc(kAlign, rounded);
    TORCH_CHECK(b->ptr, "tardy: the host could not provide ", n, " bytes for device memory");
    std::memset(b->ptr, kPoison, n);
    return {b->ptr, b, &release_block, device};
  }

  static void release_nothing(void*) {}

  c10::DeleterFnPtr raw_deleter() const override {
    return &release_block;
  }

  void copy_data(void* dst, const void* src, size_t n) const override {
    std::memcpy(dst, src, n);
  }

  bool initialized() override {
    return true;
  }

  void emptyCache(c10::MempoolId_t) override {}  // nothing is cached

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    if (ptr.get_deleter() != &release_block) return;
    State& st = state();
    Lock lock(st.mutex);
    static_cast<Block*>(ptr.get_context())->recorded |= 1u << stream.id();
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override {
    State& st = state();
    Lock lock(st.mutex);
    return st.stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex) override {
    State& st = state();
    Lock lock(st.mutex);
    for (auto* array : {&st.stats.allocation, &st.stats.segment, &st.stats.active, &st.stats.allocated_bytes,
                        &st.stats.reserved_bytes, &st.stats.active_bytes, &st.stats.requested_bytes}) {
      for (auto& stat : *array) stat.reset_accumulated();
    }
    st.stats.num_ooms = 0;
    st.stats.num_device_alloc = 0;
    st.stats.num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex) override {
    State& st = state();
    Lock lock(st.mutex);
    for (auto* array : {&st.stats.allocation, &st.stats.segment, &st.stats.active, &st.stats.allocated_bytes,
                        &st.stats.reserved_bytes, &st.stats.active_bytes, &st.stats.requested_bytes}) {
      for (auto& stat : *array) stat.reset_peak();
    }
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex) override {
    State& st = state();
    Lock lock(st.mutex);
    return {size_t(std::max<int64_t>(0, st.capacity - st.reserved)), size_t(st.capacity)};
  }
};

DeviceMemory device_memory;
REGISTER_ALLOCATOR(kType, &device_memory);

void release_pinned(void* ptr) {
  {
    State& st = state();
    Lock lock(st.mutex);
    st.pinned.erase(ptr);
  }
  std::free(ptr);
}

// Page-locked host memory, as far as torch can tell: is_pinned() is true for it, and copies
// from it read the source when they land.
struct PinnedMemory final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &DeviceMemory::release_nothing, cpu};
    void* ptr = std::aligned_alloc(kAlign, (n + kAlign - 1) / kAlign * kAlign);
    TORCH_CHECK(ptr, "tardy: the host could not provide ", n, " bytes of pinned memory");
    std::memset(ptr, kPoison, n);
    State& st = state();
    Lock lock(st.mutex);
    st.pinned.insert(ptr);
    return {ptr, ptr, &release_pinned, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release_pinned;
  }

  void copy_data(void* dst, const void* src, size_t n) const override {
    std::memcpy(dst, src, n);
  }
};

PinnedMemory pinned_memory;

bool is_pinned(const at::Tensor& t) {
  if (!t.has_storage() || t.storage().data() == nullptr) return false;
  State& st = state();
  Lock lock(st.mutex);
  return st.pinned.count(t.storage().data()) != 0;
}

// ------------------------------------------------------------------ CPU views of device memory

c10::Storage cpu_storage(const c10::Storage& device, bool resizable) {
  void* ptr = device.data_ptr().get();
  auto impl = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), device.nbytes(),
      c10::DataPtr(ptr, ptr, &DeviceMemory::release_nothing, c10::Device(c10::DeviceType::CPU)),
      c10::GetCPUAllocator(), resizable);
  return c10::Storage(std::move(impl));
}

// A tensor over `storage` shaped as `like`; an inference tensor where `inference` is given and
// true, else as the current mode makes it (a fresh tensor made inside inference mode is one).
at::Tensor view_on(const c10::Storage& storage, const at::Tensor& like, c10::DispatchKey key,
                   std::optional<bool> inference = std::nullopt) {
  std::optional<c10::InferenceMode> mode;  // TensorImpl reads the mode to choose
  if (inference && *inference != c10::InferenceMode::is_enabled()) mode.emplace(*inference);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key), like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return at::Tensor(std::move(impl));
}

// A new device storage holding a copy of a CPU storage's bytes.
c10::Storage device_copy(const c10::Storage& cpu) {
  size_t n = cpu.nbytes();
  c10::DataPtr ptr = device_memory.allocate(n);
  if (n) std::memcpy(ptr.get(), cpu.data(), n);
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), n, std::move(ptr), &device_memory, true));
}

bool on_device(const at::Tensor& t) {
  return t.defined() && t.device().type() == kType;
}

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index <= 0, "tardy: there is one tardy device (tardy:0), not tardy:", int(index));
}

// ------------------------------------------------------------------ copies

at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(on_device(src) || src.device().is_cpu(), "tardy: cannot copy from ", src.device());
  TORCH_CHECK(on_device(dst) || dst.device().is_cpu(), "tardy: cannot copy to ", dst.device());
  if (dst.numel() == 0) return dst;
  bool pageable_source = !on_device(src) && !is_pinned(src);
  bool pinned_destination = !on_device(dst) && is_pinned(dst);
  // device to device: asynchronous; host to device: when asked; device to host: when asked
  // and the host memory is pinned (into pageable memory CUDA completes the copy first)
  bool async = on_device(src) && on_device(dst) ? true : on_device(dst) ? non_blocking : non_blocking && pinned_destination;
  Item item;
  item.kind = Item::kCopy;
  // a pageable source is read now, like CUDA's staging copy; a pinned one when the copy lands
  item.src = on_device(src) ? view_on(cpu_storage(src.storage(), false), src, c10::DispatchKey::CPU)
             : (async && pageable_source) ? src.clone()
                                          : src;
  item.dst = on_device(dst) ? view_on(cpu_storage(dst.storage(), false), dst, c10::DispatchKey::CPU) : dst;
  State& st = state();
  Burial burial;
  Lock lock(st.mutex);
  raise_hazards(st);
  int sid = tls_stream;
  Stream& s = admit(st, sid);
  int64_t position = s.enqueued;
  Block* from = on_device(src) ? block_of(src.storage()) : nullptr;
  Block* to = on_device(dst) ? block_of(dst.storage()) : nullptr;
  if (from) check_use(st, from, sid, false, "a copy");
  if (to) check_use(st, to, sid, true, "a copy");
  for (Block* b : {from, to}) {
    if (b && std::find(item.blocks.begin(), item.blocks.end(), b) == item.blocks.end()) {
      item.blocks.push_back(b);
      b->pending += 1;
    }
  }
  if (from) note_use(from, sid, position, false);
  if (to) note_use(to, sid, position, true);
  st.copies += 1;
  if (async && pageable_source) st.pageable_copies += 1;
  int64_t nbytes = int64_t(dst.nbytes());
  int64_t index = enqueue(st, sid, std::move(item));
  if (st.logging) st.copy_log.push_back({sid, index, async, on_device(dst), nbytes});
  if (!async) {
    run_until(st, sid, index + 1, lock);
    host_saw(st, sid, index + 1);
  }
  // the result (a copy of `dst`) is made after the lock is let go: copying a tensor that has a
  // Python object may take the GIL, which a thread waiting for this lock may hold
  lock.unlock();
  return dst;
}

// Tensor.record_stream: the memory's reuse waits for `stream` too (neither a read nor a write).
void record_stream(at::Tensor& self, c10::Stream stream) {
  device_memory.recordStream(self.storage().data_ptr(), stream);
}

// ------------------------------------------------------------------ compute: the CPU fallback

struct Aliased {  // a device storage met in one call, and the CPU storage over the same bytes
  c10::Storage device;
  c10::Storage cpu;
  void* ptr;
  size_t nbytes;
  // whether the tensors over it are inference tensors: a result that aliases it is one exactly
  // then, as on CUDA (a view of a normal tensor is normal, in inference mode too)
  bool inference;
};

struct Call {
  std::vector<Aliased> storages;
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (device tensor, its CPU view)
  std::vector<std::pair<Block*, bool>> used;  // (memory, written)
  std::string op;

  Aliased& alias(const c10::Storage& device, bool inference) {
    for (auto& a : storages) {
      if (a.device.unsafeGetStorageImpl() == device.unsafeGetStorageImpl()) return a;
    }
    storages.push_back({device, cpu_storage(device, true), device.data_ptr().get(), device.nbytes(), inference});
    return storages.back();
  }

  const Aliased* by_cpu(const c10::StorageImpl* cpu) const {
    for (const auto& a : storages) {
      if (a.cpu.unsafeGetStorageImpl() == cpu) return &a;
    }
    return nullptr;
  }

  // `uses`: whether the kernel touches the bytes (a view only aliases them); `writes`: whether it writes them
  at::Tensor to_cpu(const at::Tensor& t, bool uses, bool writes) {
    if (!t.defined()) return t;
    if (t.device().is_cpu()) {
      TORCH_CHECK(t.dim() == 0,
          "tardy: ", op, " got a cpu tensor of shape ", t.sizes(), " next to tardy tensors; every tensor must be on "
          "the device (a .to(device) is missing), only 0-dimensional cpu tensors may join them");
      return t;
    }
    TORCH_CHECK(on_device(t), "tardy: ", op, " got a tensor on ", t.device(), " next to tardy tensors");
    at::Tensor view = view_on(alias(t.storage(), t.is_inference()).cpu, t, c10::DispatchKey::CPU);
    Block* b = uses ? block_of(t.storage()) : nullptr;
    if (b) used.emplace_back(b, writes);
    if (writes) written.emplace_back(t, view);
    return view;
  }

  c10::IValue to_cpu(const c10::IValue& value, bool uses, bool writes) {
    if (value.isTensor()) return to_cpu(value.toTensor(), uses, writes);
    if (value.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : value.toTensorList()) out.push_back(to_cpu(t, uses, writes));
      return out;
    }
    if (value.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> out;
      for (const std::optional<at::Tensor>& t : value.toOptionalTensorList()) {
        out.push_back(t.has_value() ? std::optional<at::Tensor>(to_cpu(*t, uses, writes)) : std::nullopt);
      }
      return out;
    }
    if (value.isDevice() && value.toDevice().type() == kType) return c10::Device(c10::DeviceType::CPU);
    if (value.isStorage() && value.toStorage().device_type() == kType) {
      // Tensor.set_(storage): the kernel points its CPU view at the CPU storage over the same
      // bytes, and follow_writes points the device tensor at the device storage
      return alias(value.toStorage(), c10::InferenceMode::is_enabled()).cpu;
    }
    return value;
  }

  // A CPU result back on the device: a view of a device storage of the call, or new memory.
  at::Tensor to_device(const at::Tensor& t, std::vector<std::pair<c10::StorageImpl*, c10::Storage>>& fresh) {
    if (!t.defined() || !t.device().is_cpu()) return t;
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    if (const Aliased* a = by_cpu(impl)) return view_on(a->device, t, c10::DispatchKey::PrivateUse1, a->inference);
    for (auto& [cpu, device] : fresh) {
      if (cpu == impl) return view_on(device, t, c10::DispatchKey::PrivateUse1);
    }
    fresh.emplace_back(impl, device_copy(t.storage()));
    if (Block* b = block_of(fresh.back().second)) used.emplace_back(b, true);
    return view_on(fresh.back().second, t, c10::DispatchKey::PrivateUse1);
  }

  c10::IValue to_device(const c10::IValue& value, std::vector<std::pair<c10::StorageImpl*, c10::Storage>>& fresh) {
    if (value.isTensor()) return to_device(value.toTensor(), fresh);
    if (value.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : value.toTensorList()) out.push_back(to_device(t, fresh));
      return out;
    }
    return value;
  }

  // A kernel may have resized (reallocated) or re-pointed the CPU views of its outputs: the
  // device storages and tensors follow.
  void follow_writes() {
    for (auto& a : storages) {
      c10::StorageImpl* cpu = a.cpu.unsafeGetStorageImpl();
      if (cpu->data_ptr().get() == a.ptr && cpu->nbytes() == a.nbytes) continue;
      c10::Storage moved = device_copy(a.cpu);
      c10::StorageImpl* device = a.device.unsafeGetStorageImpl();
      device->set_data_ptr_noswap(std::move(moved.unsafeGetStorageImpl()->mutable_data_ptr()));
      device->set_nbytes(moved.nbytes());
    }
    for (auto& [device, view] : written) {
      c10::TensorImpl* impl = device.unsafeGetTensorImpl();
      const Aliased* a = by_cpu(view.storage().unsafeGetStorageImpl());
      TORCH_CHECK(a, "tardy: ", op, " pointed a tensor at memory that is not on the device");
      if (impl->storage().unsafeGetStorageImpl() != a->device.unsafeGetStorageImpl()) {
        impl->set_storage_keep_dtype(a->device);
      }
      if (impl->sizes() != view.sizes() || impl->strides() != view.strides() ||
          impl->storage_offset() != view.storage_offset()) {
        impl->set_sizes_and_strides(view.sizes(), view.strides(), view.storage_offset());
      }
    }
  }
};

bool same_alias(const c10::AliasInfo* a, const c10::AliasInfo* b) {
  return a && b && a->isWrite() && b->isWrite() && a->beforeSets() == b->beforeSets();
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const auto& returns = schema.returns();
  Call call;
  call.op = schema.operator_name().name;
  if (!schema.overload_name().empty()) call.op += "." + schema.overload_name();
  auto first = stack->end() - int64_t(arguments.size());
  std::vector<c10::IValue> given(first, stack->end());
  for (size_t i = 0; i < arguments.size(); ++i) {
    // an argument annotated as aliased without a write is one a view is taken of: not read
    const c10::AliasInfo* alias = arguments[i].alias_info();
    first[int64_t(i)] = call.to_cpu(given[i], !alias || alias->isWrite(), alias && alias->isWrite());
  }
  State& st = state();
  Burial burial;
  {
    Lock lock(st.mutex);
    raise_hazards(st);
    int sid = tls_stream;
    Stream& s = admit(st, sid);
    run_until(st, sid, s.enqueued, lock);  // compute is the stream's next item
    for (auto& [b, writes] : call.used) check_use(st, b, sid, writes, call.op);
    for (auto& [b, writes] : call.used) note_use(b, sid, s.enqueued, writes);
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  call.follow_writes();
  std::vector<std::pair<c10::StorageImpl*, c10::Storage>> fresh;
  call.used.clear();
  auto out = stack->end() - int64_t(returns.size());
  for (size_t j = 0; j < returns.size(); ++j) {
    const c10::AliasInfo* alias = returns[j].alias_info();
    bool mutated = false;
    for (size_t i = 0; i < arguments.size() && alias && alias->isWrite(); ++i) {
      if (same_alias(alias, arguments[i].alias_info())) {
        out[int64_t(j)] = given[i];  // an in-place or out= result is the argument itself
        mutated = true;
        break;
      }
    }
    if (!mutated) out[int64_t(j)] = call.to_device(out[int64_t(j)], fresh);
  }
  if (!call.used.empty()) {
    Lock lock(st.mutex);
    int sid = tls_stream;
    for (auto& [b, writes] : call.used) note_use(b, sid, st.streams[sid].enqueued, true);
  }
}

// ------------------------------------------------------------------ factories

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> memory_format) {
  if (device) check_index(device->index());
  return at::detail::empty_generic(size, &device_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout>, std::optional<c10::Device> device, std::optional<bool>) {
  if (device) check_index(device->index());
  return at::detail::empty_strided_generic(size, stride, &device_memory,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::dtype_or_default(dtype));
}

// ------------------------------------------------------------------ streams and events

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kType;
  }

  c10::Device exchangeDevice(c10::Device d) const override {
    check_index(d.index());
    return c10::Device(kType, 0);
  }

  c10::Device getDevice() const override {
    return c10::Device(kType, 0);
  }

  void setDevice(c10::Device d) const override {
    check_index(d.index());
  }

  void uncheckedSetDevice(c10::Device) const noexcept override {}

  c10::Stream stream(int sid) const {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, 0), sid);
  }

  c10::Stream getStream(c10::Device) const override {
    return stream(tls_stream);
  }

  c10::Stream getDefaultStream(c10::Device) const override {
    return stream(0);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override {
    State& st = state();
    Lock lock(st.mutex);
    st.next_side = st.next_side % (kStreams - 1) + 1;
    return stream(st.next_side);
  }

  c10::Stream getNewStream(c10::Device d, int) const override {
    return getStreamFromGlobalPool(d, false);
  }

  c10::Stream exchangeStream(c10::Stream s) const override {
    TORCH_CHECK(s.id() >= 0 && s.id() < kStreams, "tardy: no stream ", s.id());
    int previous = tls_stream;
    tls_stream = int(s.id());
    return stream(previous);
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }

  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<EventHandle*>(event);
  }

  void record(void** event, const c10::Stream& s, const c10::DeviceIndex, const c10::EventFlag flag) const override {
    State& st = state();
    Lock lock(st.mutex);
    raise_hazards(st);
    auto* handle = static_cast<EventHandle*>(*event);
    if (!handle) {
      handle = new EventHandle();
      handle->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
      *event = handle;
    }
    int sid = int(s.id());
    auto mark = std::make_shared<Mark>();
    Item item;
    item.kind = Item::kRecord;
    item.mark = mark;
    mark->stream = sid;
    mark->index = enqueue(st, sid, std::move(item));
    mark->clock = st.streams[sid].clock;
    mark->clock[sid] = mark->index + 1;
    handle->mark = std::move(mark);
  }

  void block(void* event, const c10::Stream& s) const override {
    auto* handle = static_cast<EventHandle*>(event);
    if (!handle || !handle->mark) return;  // never recorded: nothing to wait for
    State& st = state();
    Lock lock(st.mutex);
    int sid = int(s.id());
    Item item;
    item.kind = Item::kWait;
    item.mark = handle->mark;
    enqueue(st, sid, std::move(item));
    merge(st.streams[sid].clock, handle->mark->clock);
  }

  bool queryEvent(void* event) const override {
    auto* handle = static_cast<EventHandle*>(event);
    if (!handle || !handle->mark) return true;
    State& st = state();
    Lock lock(st.mutex);
    if (handle->mark->done) host_saw(st, *handle->mark);
    return handle->mark->done;
  }

  bool queryStream(const c10::Stream& s) const override {
    State& st = state();
    Lock lock(st.mutex);
    Stream& stream = st.streams[s.id()];
    bool idle = stream.completed == stream.enqueued;
    if (idle) host_saw(st, int(s.id()), stream.enqueued);
    return idle;
  }

  void synchronizeStream(const c10::Stream& s) const override {
    State& st = state();
    Burial burial;
    Lock lock(st.mutex);
    int sid = int(s.id());
    int64_t target = st.streams[sid].enqueued;
    run_until(st, sid, target, lock);
    host_saw(st, sid, target);
    raise_hazards(st);
  }

  void synchronizeEvent(void* event) const override {
    auto* handle = static_cast<EventHandle*>(event);
    if (!handle || !handle->mark) return;
    State& st = state();
    Burial burial;
    Lock lock(st.mutex);
    run_until(st, handle->mark->stream, handle->mark->index + 1, lock);
    host_saw(st, *handle->mark);
    raise_hazards(st);
  }

  void synchronizeDevice(const c10::DeviceIndex) const override {
    State& st = state();
    Burial burial;
    Lock lock(st.mutex);
    synchronize_all(st, lock);
    raise_hazards(st);
  }

  void recordDataPtrOnStream(const c10::DataPtr& ptr, const c10::Stream& s) const override {
    device_memory.recordStream(ptr, s);
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<EventHandle*>(start);
    auto* b = static_cast<EventHandle*>(end);
    TORCH_CHECK(a && b && a->mark && b->mark, "tardy: elapsed_time needs two recorded events");
    TORCH_CHECK(a->timing && b->timing, "tardy: elapsed_time needs events made with enable_timing=True");
    State& st = state();
    Lock lock(st.mutex);
    for (const auto& mark : {a->mark, b->mark}) {
      run_until(st, mark->stream, mark->index + 1, lock);
      host_saw(st, *mark);
    }
    return (b->mark->at - a->mark->at) * 1e3;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ------------------------------------------------------------------ hooks

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();  // the device draws from the CPU's generator
  }
  c10::Device getDeviceFromPtr(void*) const override {
    return c10::Device(kType, 0);
  }
  bool isPinnedPtr(const void* data) const override {
    State& st = state();
    Lock lock(st.mutex);
    return st.pinned.count(data) != 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &pinned_memory;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return 1;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return 0;
  }
  void setCurrentDevice(c10::DeviceIndex index) const override {
    check_index(index);
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    check_index(index);
    return 0;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t n) const override {
    {
      State& st = state();
      Lock lock(st.mutex);
      synchronize_all(st, lock);
    }
    c10::DataPtr ptr = device_memory.allocate(n);
    size_t keep = std::min(n, storage.nbytes());
    if (keep) std::memcpy(ptr.get(), storage.data(), keep);
    storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(ptr));
    storage.unsafeGetStorageImpl()->set_nbytes(n);
  }
};

struct RegisterHooks {
  RegisterHooks() {
    at::RegisterPrivateUse1HooksInterface(new Hooks());
  }
} register_hooks;

// ------------------------------------------------------------------ what the tests control and read

void configure(int64_t capacity, double delay_low, double delay_high, bool lazy, int64_t seed) {
  TORCH_CHECK(capacity >= 0 && 0 <= delay_low && delay_low <= delay_high,
      "tardy.configure: capacity >= 0 and 0 <= delay_low <= delay_high, got ", capacity, ", ", delay_low, ", ", delay_high);
  State& st = state();
  Lock lock(st.mutex);
  synchronize_all(st, lock);
  st.capacity = capacity;
  st.delay_low = delay_low;
  st.delay_high = delay_high;
  st.lazy = lazy;
  st.rng.seed(uint64_t(seed));
  st.changed.notify_all();
}

std::vector<std::string> hazards() {
  State& st = state();
  Lock lock(st.mutex);
  return std::exchange(st.hazards, {});
}

void log_copies(bool on) {
  State& st = state();
  Lock lock(st.mutex);
  st.logging = on;
  st.copy_log.clear();
}

// The logged copies, five numbers each: stream, asynchronous, to_device, nbytes, landed (now).
std::vector<int64_t> logged_copies() {
  State& st = state();
  Lock lock(st.mutex);
  std::vector<int64_t> out;
  for (const CopyNote& c : st.copy_log) {
    bool landed = st.streams[c.stream].completed > c.index;
    out.insert(out.end(), {c.stream, c.asynchronous, c.to_device, c.nbytes, landed});
  }
  return out;
}

std::vector<int64_t> counters() {
  State& st = state();
  Lock lock(st.mutex);
  int64_t queued = 0;
  for (const auto& s : st.streams) queued += s.enqueued - s.completed;
  return {st.copies, st.pageable_copies, queued};
}


// ------------------------------------------------------------------ compute: fused RNN cells
// PyTorch's LSTM and GRU cells call a fused kernel on every device but the CPU (CUDA has its
// own; the CPU composes the cell from its ops) and no CPU kernel exists for the fallback to
// run: here the same cell, from the device's own ops (each through the fallback), with the
// activated gates as the workspace its backward reads. Below autograd, as CUDA's kernels are.

bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  at::Tensor gates = input_gates + hidden_gates;
  if (defined(input_bias)) gates = gates + *input_bias + *hidden_bias;
  auto chunks = gates.chunk(4, 1);
  at::Tensor i = chunks[0].sigmoid(), f = chunks[1].sigmoid(), g = chunks[2].tanh(), o = chunks[3].sigmoid();
  at::Tensor cy = f * cx + i * g;
  at::Tensor hy = o * cy.tanh();
  return {hy, cy, at::cat({i, f, g, o}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy, const at::Tensor& cx,
    const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  auto gates = workspace.chunk(4, 1);
  const at::Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  at::Tensor tanh_cy = cy.tanh();
  at::Tensor ghy = defined(grad_hy) ? *grad_hy : at::zeros_like(cy);
  at::Tensor gcy = ghy * o * (1 - tanh_cy * tanh_cy);
  if (defined(grad_cy)) gcy = gcy + *grad_cy;
  at::Tensor grad_gates = at::cat(
      {gcy * g * i * (1 - i), gcy * cx * f * (1 - f), gcy * i * (1 - g * g), ghy * tanh_cy * o * (1 - o)}, 1);
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {grad_gates, gcy * f, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  at::Tensor in_gates = defined(input_bias) ? input_gates + *input_bias : input_gates;
  at::Tensor hid_gates = defined(hidden_bias) ? hidden_gates + *hidden_bias : hidden_gates;
  auto ic = in_gates.chunk(3, 1);
  auto hc = hid_gates.chunk(3, 1);
  at::Tensor r = (ic[0] + hc[0]).sigmoid(), z = (ic[1] + hc[1]).sigmoid();
  at::Tensor n = (ic[2] + r * hc[2]).tanh();
  at::Tensor hy = n + z * (hx - n);
  return {hy, at::cat({r, z, n, hx, hc[2]}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  auto parts = workspace.chunk(5, 1);
  const at::Tensor &r = parts[0], &z = parts[1], &n = parts[2], &hx = parts[3], &hn = parts[4];
  at::Tensor grad_n = grad_hy * (1 - z) * (1 - n * n);  // through the tanh
  at::Tensor grad_r = grad_n * hn * r * (1 - r);
  at::Tensor grad_z = grad_hy * (hx - n) * z * (1 - z);
  at::Tensor grad_input_gates = at::cat({grad_r, grad_z, grad_n}, 1);
  at::Tensor grad_hidden_gates = at::cat({grad_r, grad_z, grad_n * r}, 1);
  return {grad_input_gates, grad_hidden_gates, grad_hy * z,
          has_bias ? grad_input_gates.sum(0) : at::Tensor(), has_bias ? grad_hidden_gates.sum(0) : at::Tensor()};
}

}  // namespace

TORCH_LIBRARY(tardy, m) {
  m.def("configure(int capacity, float delay_low, float delay_high, bool lazy, int seed) -> ()", &configure);
  m.def("hazards() -> str[]", &hazards);
  m.def("counters() -> int[]", &counters);
  m.def("log_copies(bool on) -> ()", &log_copies);
  m.def("logged_copies() -> int[]", &logged_copies);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("record_stream", TORCH_FN(record_stream));
}

// Composite operators that pick a kernel by backend would ask a PrivateUse1 backend for its
// "overrideable" variants: taken whole through the fallback instead, they run as on the CPU.
// Operators with a CPU (and CUDA) kernel and a composite one for every other backend would take
// the composite one here, which computes otherwise (and group norm's refuses a channels-last
// input, which CPU and CUDA accept): they too run the CPU's kernel through the fallback.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("native_group_norm", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("native_group_norm_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("native_layer_norm", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("native_layer_norm_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("silu_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("mish_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fused_lstm_cell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(fused_lstm_cell_backward));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fused_gru_cell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fused_gru_cell_backward));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}
