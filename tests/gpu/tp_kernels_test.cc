// The GEMM and exchange facts that tensor parallelism on the CUDA backend (D10) rests on: a
// column slice run with the full shape's pinned algorithm gives the full GEMM's columns bitwise;
// a K segment's leaf has the same bits at every degree, stride and batch; SumTree is the
// canonical order -- and the controls: the fused GEMM and a plain K split give other bits. The
// rank groups (same-device copies; NCCL when it is present), and the cost of the canonical tree
// against the fused GEMM at Qwen3-8B shapes. End to end: tp_test.cc.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/event_timer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rank_group.h"
#include "kernels/cuda/tensor_parallel.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using cuda::bf16;
using cuda::GemmOutput;

class TpGemmTest : public gpu_test::CublasLtTest<> {
 protected:
  // `count` seeded bf16 values, normal with `scale`, on the device.
  static cuda::DeviceBuffer RandomDevice(int64_t count, uint64_t key, double scale) {
    cuda::DeviceBuffer b;
    EXPECT_EQ(cudaSuccess, b.Allocate(count * 2));
    // FillRandomWeights' normal: Irwin-Hall of four 16-bit uniforms, variance
    // of one uniform sum 4 * (65536^2 - 1) / 12.
    const double unit = scale / std::sqrt((65536.0 * 65536.0 - 1.0) / 3.0);
    EXPECT_EQ(cudaSuccess,
              cuda::FillRandomWeights(key, unit, 0, count, b.get<bf16>(), nullptr, nullptr));
    return b;
  }
  template <typename T>
  static std::vector<T> Download(const void* p, int64_t count) {
    std::vector<T> host(count);
    EXPECT_EQ(cudaSuccess, cudaMemcpy(host.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

// A column-parallel slice: the rows of the full weight a rank holds, in its
// order (the runner's layouts), padded with zero rows to `padded` (lm_head
// shards).
struct Slice {
  std::vector<int64_t> rows;
  int64_t padded = 0;
};

TEST_F(TpGemmTest, ColumnSlicesWithTheFullShapesAlgorithmAreBitwiseTheFullGemmsColumns) {
  constexpr int64_t kHidden = 4096, kHd = 128, kHeads = 32, kKvHeads = 8, kInter = 12288,
                    kVocab = 151936;
  struct Case {
    const char* name;
    int64_t n;
    GemmOutput output;
    std::function<Slice(int tp, int rank)> slice;
    std::vector<int64_t> ms;
  };
  auto range = [](Slice* s, int64_t begin, int64_t count) {
    for (int64_t i = 0; i < count; ++i) s->rows.push_back(begin + i);
  };
  const std::vector<Case> cases = {
      {"qkv",
       (kHeads + 2 * kKvHeads) * kHd,
       GemmOutput::kF32,
       [&](int tp, int r) {
         Slice s;
         const int64_t h = kHeads / tp, kv = kKvHeads / tp;
         range(&s, r * h * kHd, h * kHd);
         range(&s, kHeads * kHd + r * kv * kHd, kv * kHd);
         range(&s, (kHeads + kKvHeads) * kHd + r * kv * kHd, kv * kHd);
         s.padded = static_cast<int64_t>(s.rows.size());
         return s;
       },
       {1, 5, 64, 256, 1000, 4096}},
      {"gate_up",
       2 * kInter,
       GemmOutput::kBf16,
       [&](int tp, int r) {
         Slice s;
         const int64_t i = kInter / tp;
         range(&s, r * i, i);
         range(&s, kInter + r * i, i);
         s.padded = static_cast<int64_t>(s.rows.size());
         return s;
       },
       {1, 5, 64, 256, 1000}},
      {"lm_head",
       kVocab,
       GemmOutput::kF32,
       [&](int tp, int r) {
         Slice s;
         const int64_t rows = ((kVocab + tp - 1) / tp + 63) / 64 * 64;
         const int64_t begin = std::min(kVocab, r * rows), end = std::min(kVocab, (r + 1) * rows);
         range(&s, begin, end - begin);
         s.padded = rows;
         return s;
       },
       {1, 5, 64, 256}},
  };
  for (const Case& c : cases) {
    std::unique_ptr<cuda::PinnedGemm> full;
    std::string why;
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              cuda::PinnedGemm::Create(lt_, c.n, kHidden, c.output, 256, &full, &why))
        << why;
    const size_t elem = c.output == GemmOutput::kBf16 ? 2 : 4;
    const int64_t max_m = c.ms.back();
    cuda::DeviceBuffer w = RandomDevice(c.n * kHidden, 101, 0.02);
    cuda::DeviceBuffer x = RandomDevice(max_m * kHidden, 102, 1.0);
    cuda::DeviceBuffer y_full, y_slice, w_slice;
    ASSERT_EQ(cudaSuccess, y_full.Allocate(max_m * c.n * elem));
    for (int tp : {2, 4, 8}) {
      for (int rank : {0, tp / 2, tp - 1}) {
        const Slice s = c.slice(tp, rank);
        ASSERT_EQ(cudaSuccess, w_slice.Allocate(s.padded * kHidden * 2));
        ASSERT_EQ(cudaSuccess, cudaMemset(w_slice.get(), 0, w_slice.bytes()));
        for (size_t j = 0; j < s.rows.size();) {  // one copy per run of consecutive rows
          size_t e = j + 1;
          while (e < s.rows.size() && s.rows[e] == s.rows[e - 1] + 1) ++e;
          ASSERT_EQ(cudaSuccess, cudaMemcpy(w_slice.get<bf16>() + j * kHidden,
                                            w.get<bf16>() + s.rows[j] * kHidden,
                                            (e - j) * kHidden * 2, cudaMemcpyDeviceToDevice));
          j = e;
        }
        std::unique_ptr<cuda::PinnedGemm> sliced;
        ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
                  cuda::PinnedGemm::CreateWithAlgo(lt_, s.padded, kHidden, c.output, full->algo(),
                                                   &sliced, &why))
            << c.name << " tp " << tp << ": " << why;
        if (tp == 2 && rank == 0) {
          // Informational: the algorithm the slice shape would have pinned by
          // itself.
          std::unique_ptr<cuda::PinnedGemm> own;
          if (cuda::PinnedGemm::Create(lt_, s.padded, kHidden, c.output, 256, &own) ==
              CUBLAS_STATUS_SUCCESS) {
            std::printf("[ slice    ] %-8s full n=%ld pins %s\n", c.name, static_cast<long>(c.n),
                        cuda::DescribeAlgo(full->algo()).ToString().c_str());
            std::printf("[ slice    ] %-8s own  n=%ld pins %s\n", c.name,
                        static_cast<long>(s.padded),
                        cuda::DescribeAlgo(own->algo()).ToString().c_str());
          }
        }
        ASSERT_EQ(cudaSuccess, y_slice.Allocate(max_m * s.padded * elem));
        for (int64_t m : c.ms) {
          ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
                    full->Run(x.get<bf16>(), m, w.get<bf16>(), y_full.get(), nullptr));
          ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
                    sliced->Run(x.get<bf16>(), m, w_slice.get<bf16>(), y_slice.get(), nullptr));
          ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
          const std::vector<uint8_t> a = Download<uint8_t>(y_full.get(), m * c.n * elem);
          const std::vector<uint8_t> b = Download<uint8_t>(y_slice.get(), m * s.padded * elem);
          int64_t differing = 0;
          for (int64_t i = 0; i < m; ++i) {
            for (size_t j = 0; j < s.rows.size(); ++j) {
              differing += std::memcmp(&a[(i * c.n + s.rows[j]) * elem],
                                       &b[(i * s.padded + j) * elem], elem) != 0;
            }
          }
          EXPECT_EQ(differing, 0) << c.name << " tp " << tp << " rank " << rank << " m " << m
                                  << ": output columns differ from the full GEMM's";
        }
      }
    }
  }
}

// The K segments of o_proj (K 4096) and down_proj (K 12288): every leaf
// computed by a rank of degree 1, 2, 4 or 8 -- a column block of that rank's
// input (row stride K / tp), in one batched call with its neighbours -- has the
// bits of the leaf computed alone from a contiguous copy.
TEST_F(TpGemmTest, KSegmentLeavesHaveTheSameBitsAtEveryDegreeStrideAndBatch) {
  constexpr int64_t kHidden = 4096;
  for (int64_t k_full : {int64_t{4096}, int64_t{12288}}) {
    const int64_t seg = k_full / cuda::kNumKSegments;
    std::unique_ptr<cuda::PinnedGemm> proto;
    std::string why;
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              cuda::PinnedGemm::Create(lt_, kHidden, seg, GemmOutput::kF32, 256, &proto, &why))
        << why;
    std::unique_ptr<cuda::PinnedGemm> gemm;
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              cuda::PinnedGemm::CreateWithAlgo(lt_, kHidden, seg, GemmOutput::kF32, proto->algo(),
                                               &gemm, &why, cuda::kNumKSegments))
        << why;
    std::printf("[ leaf     ] K=%ld: %s\n", static_cast<long>(k_full), gemm->Describe().c_str());
    constexpr int64_t kMaxM = 1000;
    cuda::DeviceBuffer w = RandomDevice(cuda::kNumKSegments * kHidden * seg, 201, 0.02);
    cuda::DeviceBuffer x = RandomDevice(kMaxM * k_full, 202, 1.0);
    cuda::DeviceBuffer x_part, y_ref, y;
    ASSERT_EQ(cudaSuccess, x_part.Allocate(kMaxM * k_full * 2));
    ASSERT_EQ(cudaSuccess, y_ref.Allocate(cuda::kNumKSegments * kMaxM * kHidden * 4));
    ASSERT_EQ(cudaSuccess, y.Allocate(cuda::kNumKSegments * kMaxM * kHidden * 4));
    for (int64_t m : {1, 7, 64, 256, 1000}) {
      const int64_t count = m * kHidden;
      // Reference: each leaf alone, its input a contiguous [m, K / 8] copy.
      for (int s = 0; s < cuda::kNumKSegments; ++s) {
        ASSERT_EQ(cudaSuccess, cudaMemcpy2D(x_part.get(), seg * 2, x.get<bf16>() + s * seg,
                                            k_full * 2, seg * 2, m, cudaMemcpyDeviceToDevice));
        ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
                  gemm->Run(x_part.get<bf16>(), m, w.get<bf16>() + s * kHidden * seg,
                            y_ref.get<float>() + s * count, nullptr));
      }
      const std::vector<float> want = Download<float>(y_ref.get(), cuda::kNumKSegments * count);
      for (int tp : {1, 2, 4, 8}) {
        const int local = cuda::kNumKSegments / tp;
        const int64_t k_local = k_full / tp;
        for (int r = 0; r < tp; ++r) {
          // The rank's input: its K slice as a [m, K / tp] matrix.
          ASSERT_EQ(cudaSuccess,
                    cudaMemcpy2D(x_part.get(), k_local * 2, x.get<bf16>() + r * k_local, k_full * 2,
                                 k_local * 2, m, cudaMemcpyDeviceToDevice));
          ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
                    gemm->RunBatched(x_part.get<bf16>(), k_local, seg, m,
                                     w.get<bf16>() + r * local * kHidden * seg, kHidden * seg,
                                     y.get<float>(), count, local, nullptr));
          const std::vector<float> got = Download<float>(y.get(), local * count);
          EXPECT_EQ(0, std::memcmp(got.data(), want.data() + r * local * count,
                                   local * count * sizeof(float)))
              << "K " << k_full << " m " << m << " tp " << tp << " rank " << r;
        }
      }
    }
  }
}

// SumTree is the canonical order, bitwise (a host transcription in fp32); and
// the controls: the fused GEMM over all of K, and a plain two-way split of K (a
// TP 2 without the tree), give other bits than the tree -- which is why TP 1
// runs the tree too.
TEST_F(TpGemmTest, SumTreeIsTheCanonicalOrderAndPlainReductionsAreNot) {
  constexpr int64_t kHidden = 4096, kK = 4096, kM = 64, kSeg = kK / 8;
  const int64_t count = kM * kHidden;
  const std::vector<float> parts = gpu_test::RandomFloats(8 * count, 301, 1.0f);
  const std::vector<float> base = gpu_test::RandomFloats(count, 302, 1.0f);
  cuda::DeviceBuffer d_parts = gpu_test::Upload(parts);
  cuda::DeviceBuffer d_base = gpu_test::Upload(base);
  for (int num : {1, 2, 4, 8}) {
    // mode 0, 1: SumTree without and with accumulate; 2: SumTreeOnto from another array (the
    // trainer's rt_cuda_row_parallel), into an output that starts as garbage.
    for (int mode : {0, 1, 2}) {
      const bool accumulate = mode != 0;
      cuda::DeviceBuffer out = gpu_test::Upload(mode == 2 ? parts : base);
      ASSERT_EQ(cudaSuccess,
                mode == 2 ? cuda::SumTreeOnto(d_parts.get<float>(), num, count, count,
                                              d_base.get<float>(), out.get<float>(), nullptr)
                          : cuda::SumTree(d_parts.get<float>(), num, count, count,
                                          out.get<float>(), accumulate, nullptr));
      const std::vector<float> got = gpu_test::Download<float>(out, count);
      int64_t differing = 0;
      for (int64_t i = 0; i < count; ++i) {
        float v[8];
        for (int p = 0; p < num; ++p) v[p] = parts[p * count + i];
        for (int width = num; width > 1; width /= 2) {
          for (int p = 0; p < width / 2; ++p) v[p] = v[2 * p] + v[2 * p + 1];
        }
        const float want = accumulate ? base[i] + v[0] : v[0];
        differing += std::memcmp(&got[i], &want, 4) != 0;
      }
      EXPECT_EQ(differing, 0) << num << " parts, mode " << mode;
    }
  }

  // The tree over eight leaves against one fused K walk and a plain split in
  // two halves.
  cuda::DeviceBuffer w = RandomDevice(kHidden * kK, 303, 0.02);  // [hidden, K]
  cuda::DeviceBuffer x = RandomDevice(kM * kK, 304, 1.0);
  cuda::DeviceBuffer w_seg, leaves, tree, fused, halves;
  ASSERT_EQ(cudaSuccess, w_seg.Allocate(kHidden * kK * 2));
  for (int s = 0; s < 8; ++s) {
    ASSERT_EQ(cudaSuccess, cudaMemcpy2D(w_seg.get<bf16>() + s * kHidden * kSeg, kSeg * 2,
                                        w.get<bf16>() + s * kSeg, kK * 2, kSeg * 2, kHidden,
                                        cudaMemcpyDeviceToDevice));
  }
  std::unique_ptr<cuda::PinnedGemm> leaf, whole, half;
  ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
            cuda::PinnedGemm::Create(lt_, kHidden, kSeg, GemmOutput::kF32, 256, &leaf));
  ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
            cuda::PinnedGemm::Create(lt_, kHidden, kK, GemmOutput::kF32, 256, &whole));
  ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
            cuda::PinnedGemm::Create(lt_, kHidden, kK / 2, GemmOutput::kF32, 256, &half));
  ASSERT_EQ(cudaSuccess, leaves.Allocate(8 * count * 4));
  ASSERT_EQ(cudaSuccess, tree.Allocate(count * 4));
  ASSERT_EQ(cudaSuccess, fused.Allocate(count * 4));
  ASSERT_EQ(cudaSuccess, halves.Allocate(2 * count * 4));
  for (int s = 0; s < 8; ++s) {
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              leaf->RunBatched(x.get<bf16>() + s * kSeg, kK, 0, kM,
                               w_seg.get<bf16>() + s * kHidden * kSeg, 0,
                               leaves.get<float>() + s * count, 0, 1, nullptr));
  }
  ASSERT_EQ(cudaSuccess,
            cuda::SumTree(leaves.get<float>(), 8, count, count, tree.get<float>(), false, nullptr));
  ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
            whole->Run(x.get<bf16>(), kM, w.get<bf16>(), fused.get(), nullptr));
  // A plain TP 2: each half of K in one GEMM (its weight columns as a [hidden,
  // K / 2] matrix).
  cuda::DeviceBuffer w_half;
  ASSERT_EQ(cudaSuccess, w_half.Allocate(kHidden * kK));
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(cudaSuccess, cudaMemcpy2D(w_half.get(), kK, w.get<bf16>() + r * kK / 2, kK * 2, kK,
                                        kHidden, cudaMemcpyDeviceToDevice));
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              half->RunBatched(x.get<bf16>() + r * kK / 2, kK, 0, kM, w_half.get<bf16>(), 0,
                               halves.get<float>() + r * count, 0, 1, nullptr));
  }
  cuda::DeviceBuffer plain2;
  ASSERT_EQ(cudaSuccess, plain2.Allocate(count * 4));
  ASSERT_EQ(cudaSuccess, cuda::SumTree(halves.get<float>(), 2, count, count, plain2.get<float>(),
                                       false, nullptr));
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  const std::vector<float> t = Download<float>(tree.get(), count);
  auto compare = [&](const cuda::DeviceBuffer& other, const char* what) {
    const std::vector<float> o = Download<float>(other.get(), count);
    int64_t differing = 0;
    double max_rel = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      differing += std::memcmp(&t[i], &o[i], 4) != 0;
      max_rel = std::max(max_rel, std::fabs(static_cast<double>(t[i]) - o[i]) /
                                      (std::fabs(static_cast<double>(t[i])) + 1e-3));
    }
    std::printf(
        "[ control  ] %s: %ld of %ld outputs differ from the tree (max "
        "rel %.2e)\n",
        what, static_cast<long>(differing), static_cast<long>(count), max_rel);
    EXPECT_GT(differing, 0) << what << " gave the tree's bits everywhere";
    EXPECT_LT(max_rel, 1e-2) << what << " should compute the same product";
  };
  compare(fused, "fused GEMM over all of K");
  compare(plain2, "plain two-way K split");
}

TEST(TpGroupTest, SameDeviceAllGatherCopiesEveryRankInRankOrder) {
  if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int kRanks = 4;
  constexpr int64_t kCount = 1000;
  std::vector<cudaStream_t> streams(kRanks);
  for (cudaStream_t& s : streams) {
    ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  std::unique_ptr<cuda::RankGroup> group;
  const cuda::GroupStatus created = cuda::CreateSameDeviceGroup(streams, &group);
  ASSERT_TRUE(created.ok()) << created.message();
  std::vector<cuda::DeviceBuffer> recv(kRanks), own(kRanks);
  for (int round = 0; round < 2; ++round) {  // events are reused across calls
    std::vector<const float*> send_ptrs;
    std::vector<float*> recv_ptrs;
    std::vector<std::vector<float>> sent;
    for (int r = 0; r < kRanks; ++r) {
      sent.push_back(gpu_test::RandomFloats(kCount, 400 + 10 * round + r, 1.0f));
      if (round == 0) {
        ASSERT_EQ(cudaSuccess, recv[r].Allocate(kRanks * kCount * 4));
      }
      if (r % 2 == 0) {  // in place: the rank's part already in its slot
        ASSERT_EQ(cudaSuccess, cudaMemcpy(recv[r].get<float>() + r * kCount, sent[r].data(),
                                          kCount * 4, cudaMemcpyHostToDevice));
        send_ptrs.push_back(recv[r].get<float>() + r * kCount);
      } else {
        own[r] = gpu_test::Upload(sent[r]);
        send_ptrs.push_back(own[r].get<float>());
      }
      recv_ptrs.push_back(recv[r].get<float>());
    }
    const cuda::GroupStatus s = group->AllGather(send_ptrs.data(), kCount, recv_ptrs.data());
    ASSERT_TRUE(s.ok()) << s.message();
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    for (int r = 0; r < kRanks; ++r) {
      const std::vector<float> got = gpu_test::Download<float>(recv[r], kRanks * kCount);
      for (int i = 0; i < kRanks; ++i) {
        EXPECT_EQ(0, std::memcmp(got.data() + i * kCount, sent[i].data(), kCount * 4))
            << "round " << round << ": rank " << r << " slot " << i;
      }
    }
  }
  group.reset();
  for (cudaStream_t s : streams) cudaStreamDestroy(s);
}

std::string NcclLibrary() {
  const char* path = std::getenv("ROLLOUT_NCCL_LIBRARY");
  return path != nullptr ? path : "";
}

// One NCCL rank: proves the hand-written declarations against the library that
// is loaded (version, unique id, communicator init, a group all-gather,
// destroy) on any one-GPU host.
TEST(TpNcclTest, OneRankGroupThroughTheLoadedLibraryCopies) {
  if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  int version = 0;
  const cuda::GroupStatus loaded = cuda::NcclLibraryVersion(NcclLibrary(), &version);
  if (!loaded.ok()) {
    GTEST_SKIP() << "NCCL is not loadable here (set ROLLOUT_NCCL_LIBRARY or "
                    "LD_LIBRARY_PATH): "
                 << loaded.message();
  }
  std::printf("[ nccl     ] library version %d\n", version);
  cudaStream_t stream;
  ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::unique_ptr<cuda::RankGroup> group;
  const cuda::GroupStatus created = cuda::CreateNcclGroup({0}, {stream}, NcclLibrary(), &group);
  ASSERT_TRUE(created.ok()) << created.message();
  const std::vector<float> sent = gpu_test::RandomFloats(4096, 501, 1.0f);
  cuda::DeviceBuffer send = gpu_test::Upload(sent), recv;
  ASSERT_EQ(cudaSuccess, recv.Allocate(4096 * 4));
  const float* send_ptr = send.get<float>();
  float* recv_ptr = recv.get<float>();
  const cuda::GroupStatus s = group->AllGather(&send_ptr, 4096, &recv_ptr);
  ASSERT_TRUE(s.ok()) << s.message();
  ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
  EXPECT_EQ(0, std::memcmp(gpu_test::Download<float>(recv, 4096).data(), sent.data(), 4096 * 4));
  group.reset();
  cudaStreamDestroy(stream);
}

// The multi-GPU path: one rank per device, NCCL's all-gather gives every rank
// every rank's buffer bitwise, in rank order (what the same-device group does
// with copies).
TEST(TpNcclTest, AllGatherOverTwoOrMoreGpusCopiesEveryRankInRankOrder) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    GTEST_SKIP() << "needs at least 2 GPUs (found " << devices << ")";
  }
  int version = 0;
  const cuda::GroupStatus loaded = cuda::NcclLibraryVersion(NcclLibrary(), &version);
  if (!loaded.ok()) GTEST_SKIP() << "NCCL is not loadable here: " << loaded.message();
  const int ranks = std::min(devices, 8);
  constexpr int64_t kCount = 100003;
  std::vector<int> ids(ranks);
  std::vector<cudaStream_t> streams(ranks);
  std::vector<cuda::DeviceBuffer> send(ranks), recv(ranks);
  std::vector<std::vector<float>> sent(ranks);
  std::vector<const float*> send_ptrs;
  std::vector<float*> recv_ptrs;
  for (int r = 0; r < ranks; ++r) {
    ids[r] = r;
    ASSERT_EQ(cudaSuccess, cudaSetDevice(r));
    ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    sent[r] = gpu_test::RandomFloats(kCount, 600 + r, 1.0f);
    send[r] = gpu_test::Upload(sent[r]);
    ASSERT_EQ(cudaSuccess, recv[r].Allocate(ranks * kCount * 4));
    send_ptrs.push_back(send[r].get<float>());
    recv_ptrs.push_back(recv[r].get<float>());
  }
  std::unique_ptr<cuda::RankGroup> group;
  const cuda::GroupStatus created = cuda::CreateNcclGroup(ids, streams, NcclLibrary(), &group);
  ASSERT_TRUE(created.ok()) << created.message();
  const cuda::GroupStatus s = group->AllGather(send_ptrs.data(), kCount, recv_ptrs.data());
  ASSERT_TRUE(s.ok()) << s.message();
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(cudaSuccess, cudaSetDevice(r));
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(streams[r]));
    const std::vector<float> got = gpu_test::Download<float>(recv[r], ranks * kCount);
    for (int i = 0; i < ranks; ++i) {
      EXPECT_EQ(0, std::memcmp(got.data() + i * kCount, sent[i].data(), kCount * 4))
          << "rank " << r << " slot " << i;
    }
  }
  group.reset();
  for (int r = 0; r < ranks; ++r) {
    cudaSetDevice(r);
    cudaStreamDestroy(streams[r]);
  }
  cudaSetDevice(0);
}

// ---------------------------------------------------------------------------------------------
// The cost of invariance: o_proj and down_proj at Qwen3-8B shapes, decode (m =
// 256) and prefill (m = 8192), TP 1: the fused GEMM (+ residual epilogue)
// against the canonical tree (one batched call of eight K / 8 leaf GEMMs, then
// SumTree of the leaves + residual). Also the leaves as eight separate calls,
// and whole 2-layer forward steps with canonical_k_tree off and on.

double TimeMs(const std::function<void()>& fn, int iters) {
  return cuda::MeanMilliseconds(fn, iters, /*warmups=*/3);
}

TEST_F(TpGemmTest, CostOfTheCanonicalKTreeAtQwen3_8bShapes) {
  constexpr int64_t kHidden = 4096;
  struct Proj {
    const char* name;
    int64_t k;
  };
  double per_layer[2][2] = {};  // [m index][fused, tree] ms, o + down
  const int64_t ms[2] = {256, 8192};
  for (const Proj& p : {Proj{"o_proj", 4096}, Proj{"down_proj", 12288}}) {
    const int64_t seg = p.k / 8;
    std::unique_ptr<cuda::PinnedGemm> fused, proto, leaf;
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              cuda::PinnedGemm::Create(lt_, kHidden, p.k, GemmOutput::kF32Accumulate, 256, &fused));
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              cuda::PinnedGemm::Create(lt_, kHidden, seg, GemmOutput::kF32, 256, &proto));
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              cuda::PinnedGemm::CreateWithAlgo(lt_, kHidden, seg, GemmOutput::kF32, proto->algo(),
                                               &leaf, nullptr, 8));
    cuda::DeviceBuffer w = RandomDevice(kHidden * p.k, 701, 0.02);
    cuda::DeviceBuffer x = RandomDevice(8192 * p.k, 702, 1.0);
    cuda::DeviceBuffer y, leaves;
    ASSERT_EQ(cudaSuccess, y.Allocate(8192 * kHidden * 4));
    ASSERT_EQ(cudaSuccess, cudaMemset(y.get(), 0, y.bytes()));
    ASSERT_EQ(cudaSuccess, leaves.Allocate(8 * 8192 * kHidden * 4));
    for (int mi = 0; mi < 2; ++mi) {
      const int64_t m = ms[mi], count = m * kHidden;
      const int iters = m == 256 ? 200 : 20;
      const double t_fused =
          TimeMs([&] { fused->Run(x.get<bf16>(), m, w.get<bf16>(), y.get(), nullptr); }, iters);
      const double t_leaves = TimeMs(
          [&] {
            leaf->RunBatched(x.get<bf16>(), p.k, seg, m, w.get<bf16>(), kHidden * seg,
                             leaves.get<float>(), count, 8, nullptr);
          },
          iters);
      const double t_tree = TimeMs(
          [&] {
            leaf->RunBatched(x.get<bf16>(), p.k, seg, m, w.get<bf16>(), kHidden * seg,
                             leaves.get<float>(), count, 8, nullptr);
            cuda::SumTree(leaves.get<float>(), 8, count, count, y.get<float>(), true, nullptr);
          },
          iters);
      const double t_loop = TimeMs(
          [&] {
            for (int s = 0; s < 8; ++s) {
              leaf->RunBatched(x.get<bf16>() + s * seg, p.k, 0, m,
                               w.get<bf16>() + s * kHidden * seg, 0,
                               leaves.get<float>() + s * count, 0, 1, nullptr);
            }
            cuda::SumTree(leaves.get<float>(), 8, count, count, y.get<float>(), true, nullptr);
          },
          iters);
      const double tflop = 2.0 * m * kHidden * p.k / 1e12;
      std::printf(
          "[ cost     ] %-9s m=%-5ld fused %8.1f us (%5.0f TFLOP/s) | "
          "tree %8.1f us = leaves "
          "%8.1f + SumTree %6.1f (%5.0f TFLOP/s), x%.2f | leaves one "
          "call each + SumTree %8.1f "
          "us\n",
          p.name, static_cast<long>(m), t_fused * 1e3, tflop / (t_fused * 1e-3), t_tree * 1e3,
          t_leaves * 1e3, (t_tree - t_leaves) * 1e3, tflop / (t_tree * 1e-3), t_tree / t_fused,
          t_loop * 1e3);
      per_layer[mi][0] += t_fused;
      per_layer[mi][1] += t_tree;
    }
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  }
  for (int mi = 0; mi < 2; ++mi) {
    std::printf(
        "[ cost     ] m=%-5ld o + down per layer: fused %.3f ms, tree "
        "%.3f ms: +%.3f ms per "
        "layer, +%.2f ms per 36-layer step\n",
        static_cast<long>(ms[mi]), per_layer[mi][0], per_layer[mi][1],
        per_layer[mi][1] - per_layer[mi][0], 36 * (per_layer[mi][1] - per_layer[mi][0]));
  }
}

}  // namespace
}  // namespace rollout
