// SentencePiece's own id encoder behind a C function.
//
// sentencepiece-sys exposes encoding only as a serialized SentencePieceText, whose
// per-piece strings halve the throughput. This calls the library's
// Encode(string_view, std::vector<int>*) directly and hands the ids to a Rust callback.
#include <cstddef>
#include <vector>

#include <sentencepiece_processor.h>

extern "C" {

// Encodes `len` bytes of UTF-8 at `text` with `spp` and calls `sink(ctx, ids, n)` once.
// Returns 0, or SentencePiece's status code.
int synerfuse_spp_encode_ids(sentencepiece::SentencePieceProcessor *spp, const char *text, size_t len,
                             void (*sink)(void *ctx, const int *ids, size_t n), void *ctx) {
  std::vector<int> ids;
  const auto status = spp->Encode(absl::string_view(text, len), &ids);
  if (!status.ok()) {
    return static_cast<int>(status.code());
  }
  sink(ctx, ids.data(), ids.size());
  return 0;
}

}  // extern "C"
