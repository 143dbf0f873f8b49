// A GGUF file taken apart just far enough to edit it and put it back together consistently
// (tensor offsets, alignment, data sizes), so that edited files get past the GGUF parser into the
// model loader. The fuzzer's structure-aware mutator works on this; it is not a validating reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

struct gguf_blob_kv {
    std::string          key;
    uint32_t             type      = 0; // enum gguf_type of the value, GGUF_TYPE_ARRAY for arrays
    uint32_t             elem_type = 0; // arrays only
    uint64_t             n         = 0; // arrays only: number of elements
    std::vector<uint8_t> value;         // the value as stored after its type (and element type, count)

    bool is_array_of(uint32_t t) const;
    // the elements of a numeric array (or a numeric scalar as one element), as int64
    bool get_ints(std::vector<int64_t> & out) const;
    // store values as an array of element type t (numbers, bools or decimal strings), or a scalar of
    // type t holding the first value when as_array is false
    void set_ints(const std::vector<int64_t> & values, uint32_t t, bool as_array = true);
    void set_u32(uint32_t v);
    void set_str(const std::string & s);
    bool get_str(std::string & out) const;
};

struct gguf_blob_tensor {
    std::string          name;
    std::vector<int64_t> ne;   // n_dims entries
    uint32_t             type = 0;
    std::vector<uint8_t> data; // resized to the tensor's byte size when written

    // byte size from type and shape, or SIZE_MAX where the GGUF parser would reject the tensor
    size_t nbytes() const;
};

struct gguf_blob {
    uint32_t                      version = 3;
    std::vector<gguf_blob_kv>     kv;
    std::vector<gguf_blob_tensor> tensors;

    // false if the bytes are not a GGUF file this simple reader understands
    bool parse(const uint8_t * data, size_t size);
    // the file with offsets and padding recomputed; empty if it would be larger than max_size
    std::vector<uint8_t> serialize(size_t max_size) const;

    size_t alignment() const;
    gguf_blob_kv *     find_kv(const std::string & key);
    gguf_blob_tensor * find_tensor(const std::string & name);
};

size_t gguf_blob_type_size(uint32_t gguf_type); // fixed-size value types; 0 for strings and arrays
