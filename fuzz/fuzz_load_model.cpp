// libFuzzer harness for the patched model loader: each input is a GGUF file that is loaded the way
// llama-cli loads one (llama_model_load_from_file with default parameters: full load, mmap as the
// loader decides), and when it loads, a small context is created and two tokens are decoded, so the
// NBL graph (patches 0003, 0007) and KV cache (0004) run too. A model that fails to load must fail
// with an error, never crash. See docs/fuzzing.md.
//
// LLVMFuzzerCustomMutator edits the parts the NBL patches read: <arch>.nbl.layer_types (length,
// values, element type), <arch>.nbl.taps, the names, shapes and types of attn_nbl* (the taps layers'
// too) and attention tensors, the block
// count and the architecture; the file is written back consistently (offsets, alignment, sizes) so
// that most inputs reach the model loader. Some of the time it mutates the bytes of a key's value,
// now and then those of the whole file.
//
//   FUZZ_NBL_VERBOSE=1   keep llama.cpp's log (to see why a reproducer is rejected)
//   FUZZ_NBL_LOAD_ONLY=1 load and free only, no context

#include "gguf_blob.h"

#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

extern "C" size_t LLVMFuzzerMutate(uint8_t * data, size_t size, size_t max_size);

static std::string model_path;
static int         model_fd   = -1;
static bool        verbose    = false;
static bool        load_only  = false;

static void quiet_log(ggml_log_level, const char *, void *) {}

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    verbose   = getenv("FUZZ_NBL_VERBOSE")   != nullptr;
    load_only = getenv("FUZZ_NBL_LOAD_ONLY") != nullptr;
    if (!verbose) {
        llama_log_set(quiet_log, nullptr);
    }
    // a GGML_ASSERT reports through libFuzzer's handler (stack, reproducer), not by attaching gdb
    setenv("GGML_NO_BACKTRACE", "1", 0);
    llama_backend_init();

    // the loader wants a path; an in-memory file keeps the disk out of the loop
    model_fd = memfd_create("nbl-fuzz.gguf", 0);
    if (model_fd < 0) {
        perror("memfd_create");
        abort();
    }
    model_path = "/proc/self/fd/" + std::to_string(model_fd);
    return 0;
}

static void decode_two_tokens(llama_model * model) {
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = 64;
    cparams.n_batch         = 16;
    cparams.n_ubatch        = 16;
    cparams.n_seq_max       = 1;
    cparams.n_threads       = 1;
    cparams.n_threads_batch = 1;

    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        return;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    if (n_vocab > 0) {
        llama_token tokens[2] = { 1 % n_vocab, 3 % n_vocab };
        llama_decode(ctx, llama_batch_get_one(tokens, 2));
    }
    llama_free(ctx);
}

// Upstream, ggml-cpu accepts a matmul whose weight type has no dot product (I8..I64, F64: the
// loader's buffer-type check passes) and then calls a null kernel. That is no loader bug and would
// stop every run, so a model holding such a tensor is loaded but not run (docs/fuzzing.md).
static bool has_tensor_without_cpu_kernel(const char * path) {
    gguf_init_params params = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * gguf = gguf_init_from_file(path, params);
    bool found = false;
    for (int64_t i = 0; gguf && i < gguf_get_n_tensors(gguf); ++i) {
        found |= ggml_get_type_traits_cpu(gguf_get_tensor_type(gguf, i))->vec_dot == nullptr;
    }
    gguf_free(gguf);
    return found;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (ftruncate(model_fd, 0) != 0 || pwrite(model_fd, data, size, 0) != (ssize_t) size) {
        perror("writing the model file");
        abort();
    }

    llama_model_params mparams = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (!model) {
        return 0;
    }
    if (!load_only && !has_tensor_without_cpu_kernel(model_path.c_str())) {
        decode_two_tokens(model);
    }
    llama_model_free(model);
    return 0;
}

// --- structure-aware mutator -------------------------------------------------------------------

namespace {

using rng_t = std::mt19937_64;

template <typename T> const T & pick(rng_t & rng, const std::vector<T> & items) {
    return items[rng() % items.size()];
}

// what the mutations need to know about the file being edited
struct model_view {
    gguf_blob & blob;
    std::string arch;
    int64_t     n_layer = 0;
    int64_t     n_embd  = 0;

    explicit model_view(gguf_blob & b) : blob(b) {
        if (const auto * e = blob.find_kv("general.architecture")) {
            e->get_str(arch);
        }
        std::vector<int64_t> v;
        if (const auto * e = blob.find_kv(arch + ".block_count"); e && e->get_ints(v) && !v.empty()) {
            n_layer = v[0];
        }
        if (const auto * e = blob.find_kv(arch + ".embedding_length"); e && e->get_ints(v) && !v.empty()) {
            n_embd = v[0];
        }
    }

    std::string layer_types_key() const { return arch + ".nbl.layer_types"; }
    std::string taps_key()        const { return arch + ".nbl.taps"; }
};

// tensors of a layer's attention block (what an NBL layer drops) and the NBL ones
const std::vector<std::string> ATTENTION_STEMS = {
    "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm",
};
const std::vector<std::string> STEMS = {
    "attn_nbl", "attn_nbl", "attn_nbl", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output",
    "attn_q_norm", "attn_k_norm", "post_attention_norm", "attn_norm", "ffn_norm",
};

bool parse_layer_name(const std::string & name, int64_t & layer, std::string & stem, std::string & suffix) {
    if (name.rfind("blk.", 0) != 0) {
        return false;
    }
    const size_t dot1 = name.find('.', 4);
    if (dot1 == std::string::npos) {
        return false;
    }
    const size_t dot2 = name.find('.', dot1 + 1);
    layer  = strtoll(name.c_str() + 4, nullptr, 10);
    stem   = name.substr(dot1 + 1, dot2 == std::string::npos ? std::string::npos : dot2 - dot1 - 1);
    suffix = dot2 == std::string::npos ? "" : name.substr(dot2 + 1);
    return true;
}

bool is_target(const std::string & name) {
    int64_t layer;
    std::string stem, suffix;
    return parse_layer_name(name, layer, stem, suffix) &&
           (stem.rfind("attn_nbl", 0) == 0 || std::find(ATTENTION_STEMS.begin(), ATTENTION_STEMS.end(), stem) != ATTENTION_STEMS.end());
}

// a tensor of a layer's attention block or its NBL replacement, most of the time; any tensor otherwise
gguf_blob_tensor * pick_tensor(model_view & m, rng_t & rng) {
    if (m.blob.tensors.empty()) {
        return nullptr;
    }
    std::vector<gguf_blob_tensor *> targets;
    for (auto & t : m.blob.tensors) {
        if (is_target(t.name)) {
            targets.push_back(&t);
        }
    }
    if (targets.empty() || rng() % 8 == 0) {
        return &m.blob.tensors[rng() % m.blob.tensors.size()];
    }
    return pick(rng, targets);
}

int64_t interesting_count(model_view & m, rng_t & rng) {
    const int64_t n = m.n_layer;
    return pick<int64_t>(rng, { n - 1, n + 1, n, 0, 1, 2, 3, 4, 511, 512, 513, 4096, 65535, -1,
                                (int64_t) (rng() % 600), n * 2, INT32_MAX, (int64_t) UINT32_MAX });
}

int64_t interesting_layer(model_view & m, rng_t & rng) {
    const int64_t n = m.n_layer;
    return pick<int64_t>(rng, { 0, 1, n - 1, n, n + 1, 511, 512, 4096, -1, INT32_MAX, (int64_t) (rng() % (n + 2)),
                                (int64_t) (rng() % (n + 2)), (int64_t) (rng() % (n + 2)) });
}

int64_t interesting_type_value(rng_t & rng) {
    return pick<int64_t>(rng, { 0, 1, 2, 0, 1, 2, 3, -1, -2, 255, 256, 65536, INT32_MIN, INT32_MAX,
                                (int64_t) UINT32_MAX, (int64_t) (rng() % 8), (int64_t) (int32_t) rng() });
}

std::vector<int64_t> layer_types_of(model_view & m) {
    std::vector<int64_t> v;
    if (auto * e = m.blob.find_kv(m.layer_types_key())) {
        e->get_ints(v);
    }
    return v;
}

gguf_blob_kv & layer_types_kv(model_view & m) {
    if (auto * e = m.blob.find_kv(m.layer_types_key())) {
        return *e;
    }
    gguf_blob_kv e;
    e.key = m.layer_types_key();
    e.set_ints(std::vector<int64_t>(std::max<int64_t>(m.n_layer, 0) % 1024, 0), GGUF_TYPE_INT32);
    m.blob.kv.push_back(std::move(e));
    return m.blob.kv.back();
}

// --- the mutations: each returns false if it did not apply ---

bool mutate_layer_type_value(model_view & m, rng_t & rng) {
    gguf_blob_kv & e = layer_types_kv(m);
    std::vector<int64_t> v;
    if (!e.get_ints(v) || v.empty()) {
        return false;
    }
    switch (rng() % 4) {
        case 0:  std::swap(v[rng() % v.size()], v[rng() % v.size()]); break;
        case 1:  std::fill(v.begin(), v.end(), rng() % 4); break;
        default: v[rng() % v.size()] = interesting_type_value(rng); break;
    }
    e.set_ints(v, e.type == GGUF_TYPE_ARRAY ? e.elem_type : e.type, e.type == GGUF_TYPE_ARRAY);
    return true;
}

bool mutate_layer_types_length(model_view & m, rng_t & rng) {
    gguf_blob_kv & e = layer_types_kv(m);
    std::vector<int64_t> v;
    if (!e.get_ints(v)) {
        return false;
    }
    int64_t n = interesting_count(m, rng);
    n = n < 0 ? 0 : std::min<int64_t>(n, 4096); // longer arrays only make the file large
    while ((int64_t) v.size() < n) {
        v.push_back(rng() % 3);
    }
    v.resize(n);
    e.set_ints(v, e.type == GGUF_TYPE_ARRAY ? e.elem_type : GGUF_TYPE_INT32);
    return true;
}

bool mutate_layer_types_element_type(model_view & m, rng_t & rng) {
    gguf_blob_kv & e = layer_types_kv(m);
    std::vector<int64_t> v;
    if (!e.get_ints(v)) {
        return false;
    }
    const uint32_t t = pick<uint32_t>(rng, {
        GGUF_TYPE_UINT8, GGUF_TYPE_INT8, GGUF_TYPE_UINT16, GGUF_TYPE_INT16, GGUF_TYPE_UINT32, GGUF_TYPE_INT32,
        GGUF_TYPE_FLOAT32, GGUF_TYPE_BOOL, GGUF_TYPE_STRING, GGUF_TYPE_UINT64, GGUF_TYPE_INT64, GGUF_TYPE_FLOAT64,
    });
    e.set_ints(v, t, rng() % 4 != 0); // now and then a scalar instead of an array
    return true;
}

bool mutate_layer_types_key(model_view & m, rng_t & rng) {
    auto & kv = m.blob.kv;
    for (size_t i = 0; i < kv.size(); ++i) {
        if (kv[i].key != m.layer_types_key()) {
            continue;
        }
        if (rng() % 2) {
            kv.erase(kv.begin() + i);
        } else {
            // the key of another architecture, or a near miss
            kv[i].key = pick<std::string>(rng, { "llama", "qwen2", "gemma3", "gpt2", "nbl", "" }) +
                        pick<std::string>(rng, { ".nbl.layer_types", ".nbl.layer_type", ".nbl.layer_types.0" });
        }
        return true;
    }
    // a file without the key gets one, with one type per layer
    std::vector<int64_t> v(std::clamp<int64_t>(m.n_layer, 0, 1024));
    for (auto & x : v) {
        x = rng() % 3;
    }
    gguf_blob_kv e;
    e.key = m.layer_types_key();
    e.set_ints(v, GGUF_TYPE_INT32);
    kv.push_back(std::move(e));
    return true;
}

bool mutate_block_count(model_view & m, rng_t & rng) {
    auto * e = m.blob.find_kv(m.arch + ".block_count");
    if (!e) {
        return false;
    }
    // 0 and more than LLAMA_MAX_LAYERS (512) stop at an upstream GGML_ASSERT before any NBL code runs
    // (docs/fuzzing.md), so the mutator stays within 1..512; the byte-level mutations still go outside
    int64_t n = interesting_count(m, rng);
    if (n < 1 || n > 512) {
        n = 1 + rng() % 512;
    }
    if (rng() % 2) {
        n = std::max<int64_t>(1, std::min<int64_t>(512, layer_types_of(m).size())); // agree with the layer types
    }
    e->set_u32((uint32_t) n);
    return true;
}

bool mutate_architecture(model_view & m, rng_t & rng) {
    auto * e = m.blob.find_kv("general.architecture");
    if (!e || m.arch.empty()) {
        return false;
    }
    // supported ones, and some that are not: their loaders must never see NBL layer types
    const std::string to = pick<std::string>(rng, {
        "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm3",
        "gpt2", "mistral3", "gemma", "qwen2moe", "granite", "mamba", "bert", "t5", "deci", "llama4", "olmo2",
    });
    e->set_str(to);
    for (auto & kv : m.blob.kv) {
        if (kv.key.rfind(m.arch + ".", 0) == 0) {
            kv.key = to + kv.key.substr(m.arch.size());
        }
    }
    return true;
}

std::string layer_tensor_name(int64_t layer, const std::string & stem, const std::string & suffix) {
    return "blk." + std::to_string(layer) + "." + stem + (suffix.empty() ? "" : "." + suffix);
}

bool mutate_tensor_name(model_view & m, rng_t & rng) {
    gguf_blob_tensor * t = pick_tensor(m, rng);
    if (!t) {
        return false;
    }
    int64_t layer = 0;
    std::string stem = "attn_nbl", suffix = "weight";
    parse_layer_name(t->name, layer, stem, suffix);

    std::string name;
    switch (rng() % 6) {
        case 0: name = layer_tensor_name(interesting_layer(m, rng), stem, suffix); break;
        case 1: name = layer_tensor_name(layer, pick(rng, STEMS), suffix); break;
        case 2: name = layer_tensor_name(layer, stem, pick<std::string>(rng, { "weight", "bias", "", "weight.weight", "scale" })); break;
        case 3: name = layer_tensor_name(interesting_layer(m, rng), pick(rng, STEMS), pick<std::string>(rng, { "weight", "bias" })); break;
        case 4: {
            // the parser's limit is 63 characters
            name = t->name + std::string(rng() % 70, 'x');
            name.resize(std::min<size_t>(name.size(), 63 + rng() % 2));
        } break;
        default: {
            // drop it
            m.blob.tensors.erase(m.blob.tensors.begin() + (t - m.blob.tensors.data()));
            return true;
        }
    }
    if (m.blob.find_tensor(name)) {
        return false; // duplicate names stop at the GGUF parser
    }
    if (rng() % 3 == 0) {
        gguf_blob_tensor copy = *t;
        copy.name = name;
        m.blob.tensors.insert(m.blob.tensors.begin() + rng() % (m.blob.tensors.size() + 1), std::move(copy));
    } else {
        t->name = name;
    }
    return true;
}

int64_t interesting_dim(model_view & m, rng_t & rng) {
    const int64_t d = m.n_embd > 0 ? m.n_embd : 32;
    return pick<int64_t>(rng, { d, d, d + 1, d - 1, d * 2, d / 2, 0, 1, 2, 16, 32, 64, 256, 3 * d,
                                1 << 16, (int64_t) 1 << 31, (int64_t) 1 << 40, -1, (int64_t) (rng() % (4 * d)) });
}

// data of the new size: kept where it overlaps, zeros beyond (the values do not matter to the loader,
// and zeros keep the decode free of NaNs)
void resize_data(gguf_blob_tensor & t) {
    const size_t n = t.nbytes();
    if (n != SIZE_MAX && n <= (1u << 22)) {
        t.data.resize(n, 0);
    }
}

bool mutate_tensor_shape(model_view & m, rng_t & rng) {
    gguf_blob_tensor * t = pick_tensor(m, rng);
    if (!t) {
        return false;
    }
    switch (rng() % 4) {
        case 0: t->ne.resize(rng() % (GGML_MAX_DIMS + 1), 1); break;
        case 1: if (t->ne.size() >= 2) { std::swap(t->ne[0], t->ne[1]); } break;
        default:
            if (t->ne.empty()) {
                t->ne.push_back(1);
            }
            t->ne[rng() % t->ne.size()] = interesting_dim(m, rng);
            break;
    }
    resize_data(*t);
    return true;
}

bool mutate_tensor_type(model_view & m, rng_t & rng) {
    gguf_blob_tensor * t = pick_tensor(m, rng);
    if (!t) {
        return false;
    }
    t->type = pick<uint32_t>(rng, {
        GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
        GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_IQ4_NL, GGML_TYPE_IQ2_XXS, GGML_TYPE_TQ1_0, GGML_TYPE_MXFP4,
        GGML_TYPE_I8, GGML_TYPE_I16, GGML_TYPE_I32, GGML_TYPE_I64, GGML_TYPE_F64,
        4, 5, GGML_TYPE_COUNT, GGML_TYPE_COUNT + 1, UINT32_MAX, (uint32_t) (rng() % GGML_TYPE_COUNT),
    });
    // keep the row a whole number of blocks now and then, so that the tensor gets past the parser
    if (rng() % 2 && !t->ne.empty() && t->type < GGML_TYPE_COUNT) {
        const int64_t blck = ggml_blck_size((ggml_type) t->type);
        if (blck > 1 && t->ne[0] % blck != 0) {
            t->ne[0] = (t->ne[0] / blck + 1) * blck;
        }
    }
    resize_data(*t);
    return true;
}

// a consistent change of one layer's type: tensors and layer types agree, so the model loads and
// reaches the graph with a new layer configuration
bool mutate_layer_consistently(model_view & m, rng_t & rng) {
    std::vector<int64_t> types = layer_types_of(m);
    if (types.empty() || m.n_embd <= 0 || m.n_embd > 4096) {
        return false;
    }
    const int64_t il = rng() % types.size();
    const int64_t to = rng() % 3;

    // an attention layer to copy the attention tensors from
    int64_t donor = -1;
    for (size_t j = 0; j < types.size(); ++j) {
        if (types[j] == 0 && (int64_t) j != il && m.blob.find_tensor(layer_tensor_name(j, "attn_output", "weight"))) {
            donor = j;
            break;
        }
    }
    if (to == 0 && donor < 0) {
        return false;
    }

    auto & ts = m.blob.tensors;
    ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const gguf_blob_tensor & t) {
        int64_t layer;
        std::string stem, suffix;
        return parse_layer_name(t.name, layer, stem, suffix) && layer == il && is_target(t.name);
    }), ts.end());

    std::vector<gguf_blob_tensor> added;
    if (to == 0) {
        for (const auto & t : ts) {
            int64_t layer;
            std::string stem, suffix;
            if (parse_layer_name(t.name, layer, stem, suffix) && layer == donor && is_target(t.name)) {
                added.push_back(t);
                added.back().name = layer_tensor_name(il, stem, suffix);
            }
        }
    } else if (to == 1) {
        gguf_blob_tensor w { layer_tensor_name(il, "attn_nbl", "weight"), { m.n_embd, m.n_embd },
                             pick<uint32_t>(rng, { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0 }), {} };
        gguf_blob_tensor b { layer_tensor_name(il, "attn_nbl", "bias"), { m.n_embd }, GGML_TYPE_F32, {} };
        resize_data(w);
        resize_data(b);
        added = { w, b };
    }
    ts.insert(ts.end(), added.begin(), added.end());
    types[il] = to;
    gguf_blob_kv & e = layer_types_kv(m);
    e.set_ints(types, e.type == GGUF_TYPE_ARRAY ? e.elem_type : GGUF_TYPE_INT32, e.type == GGUF_TYPE_ARRAY);
    return true;
}

// libFuzzer's byte-level mutations on the value of one of the keys the patches read or write: the
// layer types, the architecture and nbl.* (other keys belong to upstream: the block count, for one,
// stops at an upstream GGML_ASSERT outside 1..512, see mutate_block_count); the value stays
// self-consistent where its type allows (whole elements, a string's length)
bool mutate_kv_bytes(model_view & m, rng_t & rng) {
    std::vector<gguf_blob_kv *> keys;
    for (auto & e : m.blob.kv) {
        if (e.key == m.layer_types_key() || e.key == m.taps_key() || e.key == "general.architecture" || e.key.rfind("nbl.", 0) == 0) {
            keys.push_back(&e);
        }
    }
    if (keys.empty()) {
        return false;
    }
    gguf_blob_kv & e = *pick(rng, keys);
    std::vector<uint8_t> bytes = e.value;
    const size_t max_size = bytes.size() * 2 + 16;
    bytes.resize(max_size);
    bytes.resize(LLVMFuzzerMutate(bytes.data(), e.value.size(), max_size));
    if (e.type == GGUF_TYPE_STRING) {
        if (bytes.size() < sizeof(uint64_t)) {
            return false;
        }
        e.set_str(std::string(bytes.begin() + sizeof(uint64_t), bytes.end()));
        return true;
    }
    const size_t width = gguf_blob_type_size(e.type == GGUF_TYPE_ARRAY ? e.elem_type : e.type);
    if (width == 0) {
        e.value = bytes; // an array of strings: whatever the parser makes of it
        return true;
    }
    bytes.resize(e.type == GGUF_TYPE_ARRAY ? bytes.size() / width * width : width, 0);
    e.value = bytes;
    if (e.type == GGUF_TYPE_ARRAY) {
        e.n = bytes.size() / width;
    }
    return true;
}

using mutation = bool (*)(model_view &, rng_t &);

const std::vector<mutation> MUTATIONS = {
    mutate_layer_type_value, mutate_layer_type_value, mutate_layer_types_length, mutate_layer_types_element_type,
    mutate_layer_types_key, mutate_block_count, mutate_architecture,
    mutate_tensor_name, mutate_tensor_name, mutate_tensor_shape, mutate_tensor_shape, mutate_tensor_type,
    mutate_layer_consistently, mutate_layer_consistently, mutate_layer_consistently,
    mutate_kv_bytes, mutate_kv_bytes,
};

} // namespace

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t * data, size_t size, size_t max_size, unsigned int seed) {
    rng_t rng(seed);
    gguf_blob blob;
    // one input in twenty gets libFuzzer's byte-level mutations over the whole file, as do the ones
    // this reader cannot take apart
    if (rng() % 20 != 0 && blob.parse(data, size)) {
        for (int attempt = 0; attempt < 4; ++attempt) {
            gguf_blob edited = blob;
            bool changed = false;
            for (int i = 0, n = 1 + rng() % 3; i < n; ++i) {
                model_view m(edited); // anew each time: the architecture or block count may have changed
                changed |= pick(rng, MUTATIONS)(m, rng);
            }
            if (!changed) {
                continue;
            }
            const std::vector<uint8_t> out = edited.serialize(max_size);
            if (!out.empty()) {
                memcpy(data, out.data(), out.size());
                return out.size();
            }
        }
    }
    return LLVMFuzzerMutate(data, size, max_size);
}
