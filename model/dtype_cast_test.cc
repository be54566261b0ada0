#include "model/dtype_cast.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rollout {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> F32Bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::vector<uint16_t> Halves(const std::vector<uint8_t>& bytes) {
  std::vector<uint16_t> halves(bytes.size() / 2);
  std::memcpy(halves.data(), bytes.data(), bytes.size());
  return halves;
}

TEST(DTypeCastTest, ServedDTypeIsTheConfigsTorchDtype) {
  ModelConfig c;
  EXPECT_EQ(ServedDType(c), DType::kBF16);  // the default
  c.torch_dtype = "float32";
  EXPECT_EQ(ServedDType(c), DType::kF32);
  c.torch_dtype = "float16";
  EXPECT_EQ(ServedDType(c), DType::kF16);
}

// bf16 keeps 8 significant bits: 1 + 2^-8 is exactly between 1 and 1 + 2^-7 and goes to the even
// one (1); 1 + 3 * 2^-8 is between 1 + 2^-7 (odd) and 1 + 2^-6 and goes up to 1 + 2^-6.
TEST(DTypeCastTest, F32ToBf16RoundsToNearestEven) {
  const std::vector<float> in = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f,
                                 -2.5f, 0.0f, -0.0f};
  std::vector<uint8_t> out(in.size() * 2);
  ASSERT_TRUE(CastFloats("t", DType::kF32, F32Bytes(in).data(), in.size(), DType::kBF16,
                         out.data())
                  .ok());
  const std::vector<uint16_t> h = Halves(out);
  EXPECT_EQ(h[0], 0x3f80);  // 1
  EXPECT_EQ(h[1], 0x3f82);  // 1 + 2^-6
  EXPECT_EQ(h[2], 0x3f81);  // above the tie: up
  EXPECT_EQ(h[3], 0xc020);  // -2.5 exactly
  EXPECT_EQ(h[4], 0x0000);
  EXPECT_EQ(h[5], 0x8000);
}

TEST(DTypeCastTest, WideningIsExactAndNarrowingBackRestoresTheBits) {
  // Every bf16 bit pattern that is a finite number, to f32 and back.
  std::vector<uint16_t> all;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if (((b >> 7) & 0xff) != 0xff) all.push_back(static_cast<uint16_t>(b));
  }
  std::vector<uint8_t> f32(all.size() * 4), back(all.size() * 2);
  ASSERT_TRUE(CastFloats("t", DType::kBF16, reinterpret_cast<const uint8_t*>(all.data()),
                         all.size(), DType::kF32, f32.data())
                  .ok());
  ASSERT_TRUE(CastFloats("t", DType::kF32, f32.data(), all.size(), DType::kBF16, back.data()).ok());
  EXPECT_EQ(Halves(back), all);
  // f16 -> bf16 -> f32: the f32 value is the nearest bf16 of the f16 value.
  const uint16_t f16_third = 0x3555;  // 0.333251953125 in f16
  uint8_t bf16[2];
  ASSERT_TRUE(CastFloats("t", DType::kF16, reinterpret_cast<const uint8_t*>(&f16_third), 1,
                         DType::kBF16, bf16)
                  .ok());
  uint16_t bf16_bits;
  std::memcpy(&bf16_bits, bf16, 2);
  EXPECT_EQ(bf16_bits, F32ToBF16(F16ToF32(f16_third)));
}

TEST(DTypeCastTest, OverflowIntoF16IsRefusedNamingTheTensorAndNothingIsCast) {
  const std::vector<float> in = {1.0f, 65504.0f, 70000.0f};
  std::vector<uint8_t> out(in.size() * 2);
  const absl::Status s =
      CastFloats("model.norm.weight", DType::kF32, F32Bytes(in).data(), in.size(), DType::kF16,
                 out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(s.message(), HasSubstr("element 2"));
  EXPECT_THAT(s.message(), HasSubstr("F16"));
  // Infinities and NaNs are values, not overflows: they stay what they are.
  const std::vector<float> special = {std::numeric_limits<float>::infinity(), std::nanf("")};
  std::vector<uint8_t> special_out(4);
  ASSERT_TRUE(CastFloats("t", DType::kF32, F32Bytes(special).data(), 2, DType::kF16,
                         special_out.data())
                  .ok());
  EXPECT_EQ(Halves(special_out)[0], 0x7c00);
  EXPECT_TRUE(std::isnan(F16ToF32(Halves(special_out)[1])));

  std::vector<float> values = in;
  EXPECT_FALSE(RoundToDType("t", DType::kF16, values.data(), values.size()).ok());
  EXPECT_EQ(values, in);  // untouched on error
}

TEST(DTypeCastTest, RoundToDTypeGivesTheValuesOfTheCastBytes) {
  std::vector<float> values = {0.1f, -3.14159f, 1e-30f, 1000.5f};
  const std::vector<float> in = values;
  ASSERT_TRUE(RoundToDType("t", DType::kBF16, values.data(), values.size()).ok());
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(values[i], BF16ToF32(F32ToBF16(in[i]))) << i;
  std::vector<float> same = in;
  ASSERT_TRUE(RoundToDType("t", DType::kF32, same.data(), same.size()).ok());
  EXPECT_EQ(same, in);
}

TEST(DTypeCastTest, CastTensorToReplacesBytesAndDtype) {
  HostTensor t{"w", DType::kF32, {2}, F32Bytes({1.0f, -2.0f})};
  ASSERT_TRUE(CastTensorTo(DType::kBF16, &t).ok());
  EXPECT_EQ(t.dtype, DType::kBF16);
  EXPECT_EQ(Halves(t.bytes), std::vector<uint16_t>({0x3f80, 0xc000}));
  ASSERT_TRUE(CastTensorTo(DType::kBF16, &t).ok());  // already: unchanged
  EXPECT_EQ(t.bytes.size(), 4u);
  HostTensor big{"w", DType::kF32, {1}, F32Bytes({1e6f})};
  EXPECT_FALSE(CastTensorTo(DType::kF16, &big).ok());
  EXPECT_EQ(big.dtype, DType::kF32);
  EXPECT_EQ(big.bytes.size(), 4u);
}

// A pushed tensor in another float dtype is cast to its spec's, not refused; a wrong name,
// shape or byte count still is, naming the tensor.
TEST(DTypeCastTest, CastToSpecCastsPushedTensorsToTheServedDtype) {
  const std::vector<WeightSpec> specs = {{"a", DType::kBF16, {2}}, {"b", DType::kF32, {1}}};
  HostTensor f32{"a", DType::kF32, {2}, F32Bytes({1.0f, 0.1f})};
  ASSERT_TRUE(CastToSpec(specs, &f32).ok());
  EXPECT_EQ(f32.dtype, DType::kBF16);
  EXPECT_EQ(Halves(f32.bytes), std::vector<uint16_t>({0x3f80, F32ToBF16(0.1f)}));
  HostTensor bf16{"b", DType::kBF16, {1}, {0x80, 0x3f}};  // 1.0 widened to F32
  ASSERT_TRUE(CastToSpec(specs, &bf16).ok());
  EXPECT_EQ(bf16.dtype, DType::kF32);
  EXPECT_EQ(bf16.bytes, F32Bytes({1.0f}));
  HostTensor served{"a", DType::kBF16, {2}, {1, 2, 3, 4}};
  ASSERT_TRUE(CastToSpec(specs, &served).ok());
  EXPECT_EQ(served.bytes, std::vector<uint8_t>({1, 2, 3, 4}));  // already served: untouched

  struct Case {
    HostTensor tensor;
    const char* message;
  };
  for (Case& c : std::vector<Case>{
           {{"c", DType::kF32, {2}, F32Bytes({1, 2})}, "not a weight of the served model"},
           {{"a", DType::kF32, {3}, F32Bytes({1, 2, 3})}, "shape [3] given, expected [2]"},
           {{"a", DType::kF32, {2}, F32Bytes({1})}, "4 bytes given"}}) {
    const HostTensor before = c.tensor;
    const absl::Status s = CastToSpec(specs, &c.tensor);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
    EXPECT_EQ(c.tensor.bytes, before.bytes);
    EXPECT_EQ(c.tensor.dtype, before.dtype);
  }
}

}  // namespace
}  // namespace rollout
