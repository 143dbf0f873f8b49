#include "gguf_blob.h"

#include "ggml.h"
#include "gguf.h"

#include <cstring>
#include <string>

// keeps a mutated file within what libFuzzer handles well; the seeds have a few dozen of each
static constexpr uint64_t MAX_ITEMS = 1 << 16;

size_t gguf_blob_type_size(uint32_t t) {
    switch (t) {
        case GGUF_TYPE_UINT8:
        case GGUF_TYPE_INT8:
        case GGUF_TYPE_BOOL:    return 1;
        case GGUF_TYPE_UINT16:
        case GGUF_TYPE_INT16:   return 2;
        case GGUF_TYPE_UINT32:
        case GGUF_TYPE_INT32:
        case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64:
        case GGUF_TYPE_INT64:
        case GGUF_TYPE_FLOAT64: return 8;
        default:                return 0;
    }
}

namespace {

struct reader {
    const uint8_t * data;
    size_t          size;
    size_t          pos = 0;

    template <typename T> bool read(T & v) {
        if (size - pos < sizeof(T)) {
            return false;
        }
        memcpy(&v, data + pos, sizeof(T));
        pos += sizeof(T);
        return true;
    }

    bool read_bytes(size_t n, std::vector<uint8_t> & out) {
        if (size - pos < n) {
            return false;
        }
        out.insert(out.end(), data + pos, data + pos + n);
        pos += n;
        return true;
    }

    bool read_str(std::string & s) {
        uint64_t n;
        if (!read(n) || n > size - pos) {
            return false;
        }
        s.assign((const char *) data + pos, n);
        pos += n;
        return true;
    }

    // one value of type t, appended as stored in the file
    bool read_value(uint32_t t, std::vector<uint8_t> & out) {
        if (t == GGUF_TYPE_STRING) {
            uint64_t n;
            if (!read(n) || n > size - pos) {
                return false;
            }
            out.insert(out.end(), (const uint8_t *) &n, (const uint8_t *) &n + sizeof(n));
            return read_bytes(n, out);
        }
        const size_t n = gguf_blob_type_size(t);
        return n > 0 && read_bytes(n, out);
    }
};

struct writer {
    std::vector<uint8_t> buf;

    template <typename T> void write(const T & v) {
        buf.insert(buf.end(), (const uint8_t *) &v, (const uint8_t *) &v + sizeof(T));
    }
    void write_bytes(const std::vector<uint8_t> & bytes) { buf.insert(buf.end(), bytes.begin(), bytes.end()); }
    void write_str(const std::string & s) {
        write<uint64_t>(s.size());
        buf.insert(buf.end(), s.begin(), s.end());
    }
    void pad(size_t alignment) { buf.resize((buf.size() + alignment - 1) / alignment * alignment, 0); }
};

} // namespace

bool gguf_blob_kv::is_array_of(uint32_t t) const {
    return type == GGUF_TYPE_ARRAY && elem_type == t;
}

static int64_t decode_int(uint32_t t, const uint8_t * p) {
    switch (t) {
        case GGUF_TYPE_UINT8:   return *p;
        case GGUF_TYPE_INT8:    return (int8_t) *p;
        case GGUF_TYPE_BOOL:    return *p != 0;
        case GGUF_TYPE_UINT16:  { uint16_t v; memcpy(&v, p, 2); return v; }
        case GGUF_TYPE_INT16:   { int16_t  v; memcpy(&v, p, 2); return v; }
        case GGUF_TYPE_UINT32:  { uint32_t v; memcpy(&v, p, 4); return v; }
        case GGUF_TYPE_INT32:   { int32_t  v; memcpy(&v, p, 4); return v; }
        case GGUF_TYPE_FLOAT32: { float    v; memcpy(&v, p, 4); return v > -9.2e18f && v < 9.2e18f ? (int64_t) v : 0; }
        case GGUF_TYPE_UINT64:  { uint64_t v; memcpy(&v, p, 8); return (int64_t) v; }
        case GGUF_TYPE_INT64:   { int64_t  v; memcpy(&v, p, 8); return v; }
        case GGUF_TYPE_FLOAT64: { double   v; memcpy(&v, p, 8); return v > -9.2e18 && v < 9.2e18 ? (int64_t) v : 0; }
        default:                return 0;
    }
}

static void encode_value(uint32_t t, int64_t v, std::vector<uint8_t> & out) {
    auto put = [&](const auto & x) { out.insert(out.end(), (const uint8_t *) &x, (const uint8_t *) &x + sizeof(x)); };
    switch (t) {
        case GGUF_TYPE_UINT8:   put((uint8_t)  v); break;
        case GGUF_TYPE_INT8:    put((int8_t)   v); break;
        case GGUF_TYPE_BOOL:    put((uint8_t) (v != 0)); break;
        case GGUF_TYPE_UINT16:  put((uint16_t) v); break;
        case GGUF_TYPE_INT16:   put((int16_t)  v); break;
        case GGUF_TYPE_UINT32:  put((uint32_t) v); break;
        case GGUF_TYPE_INT32:   put((int32_t)  v); break;
        case GGUF_TYPE_FLOAT32: put((float)    v); break;
        case GGUF_TYPE_UINT64:  put((uint64_t) v); break;
        case GGUF_TYPE_INT64:   put((int64_t)  v); break;
        case GGUF_TYPE_FLOAT64: put((double)   v); break;
        case GGUF_TYPE_STRING: {
            const std::string s = std::to_string(v);
            put((uint64_t) s.size());
            out.insert(out.end(), s.begin(), s.end());
        } break;
        default: break;
    }
}

bool gguf_blob_kv::get_ints(std::vector<int64_t> & out) const {
    out.clear();
    const uint32_t t = type == GGUF_TYPE_ARRAY ? elem_type : type;
    const size_t   w = gguf_blob_type_size(t);
    if (w == 0) {
        return false;
    }
    const uint64_t count = type == GGUF_TYPE_ARRAY ? n : 1;
    if (count > value.size() / w) {
        return false;
    }
    for (uint64_t i = 0; i < count; ++i) {
        out.push_back(decode_int(t, value.data() + i * w));
    }
    return true;
}

void gguf_blob_kv::set_ints(const std::vector<int64_t> & values, uint32_t t, bool as_array) {
    value.clear();
    if (as_array) {
        type      = GGUF_TYPE_ARRAY;
        elem_type = t;
        n         = values.size();
        for (int64_t v : values) {
            encode_value(t, v, value);
        }
    } else {
        type = t;
        encode_value(t, values.empty() ? 0 : values[0], value);
    }
}

void gguf_blob_kv::set_u32(uint32_t v) {
    set_ints({ (int64_t) v }, GGUF_TYPE_UINT32, false);
}

void gguf_blob_kv::set_str(const std::string & s) {
    type = GGUF_TYPE_STRING;
    value.clear();
    const uint64_t len = s.size();
    value.insert(value.end(), (const uint8_t *) &len, (const uint8_t *) &len + sizeof(len));
    value.insert(value.end(), s.begin(), s.end());
}

bool gguf_blob_kv::get_str(std::string & out) const {
    uint64_t len;
    if (type != GGUF_TYPE_STRING || value.size() < sizeof(len)) {
        return false;
    }
    memcpy(&len, value.data(), sizeof(len));
    if (len != value.size() - sizeof(len)) {
        return false;
    }
    out.assign((const char *) value.data() + sizeof(len), len);
    return true;
}

size_t gguf_blob_tensor::nbytes() const {
    if (type >= GGML_TYPE_COUNT || ne.size() > GGML_MAX_DIMS) {
        return SIZE_MAX;
    }
    const int64_t blck = ggml_blck_size((ggml_type) type);
    if (blck <= 0) {
        return SIZE_MAX;
    }
    uint64_t n = 1;
    for (size_t i = 0; i < ne.size(); ++i) {
        if (ne[i] < 0 || (i == 0 && ne[i] % blck != 0)) {
            return SIZE_MAX;
        }
        if (ne[i] != 0 && n > (uint64_t(1) << 40) / (uint64_t) ne[i]) {
            return SIZE_MAX; // far beyond any file the fuzzer writes
        }
        n *= (uint64_t) ne[i];
    }
    return n / blck * ggml_type_size((ggml_type) type);
}

size_t gguf_blob::alignment() const {
    for (const auto & e : kv) {
        if (e.key == GGUF_KEY_GENERAL_ALIGNMENT && e.type == GGUF_TYPE_UINT32 && e.value.size() == 4) {
            uint32_t a;
            memcpy(&a, e.value.data(), 4);
            return a != 0 && (a & (a - 1)) == 0 ? a : GGUF_DEFAULT_ALIGNMENT;
        }
    }
    return GGUF_DEFAULT_ALIGNMENT;
}

gguf_blob_kv * gguf_blob::find_kv(const std::string & key) {
    for (auto & e : kv) {
        if (e.key == key) {
            return &e;
        }
    }
    return nullptr;
}

gguf_blob_tensor * gguf_blob::find_tensor(const std::string & name) {
    for (auto & t : tensors) {
        if (t.name == name) {
            return &t;
        }
    }
    return nullptr;
}

bool gguf_blob::parse(const uint8_t * data, size_t size) {
    reader r { data, size };
    char magic[4];
    int64_t n_tensors, n_kv;
    if (!r.read(magic) || memcmp(magic, GGUF_MAGIC, 4) != 0 || !r.read(version) ||
        !r.read(n_tensors) || !r.read(n_kv) ||
        n_tensors < 0 || n_kv < 0 || (uint64_t) n_tensors > MAX_ITEMS || (uint64_t) n_kv > MAX_ITEMS) {
        return false;
    }

    kv.clear();
    for (int64_t i = 0; i < n_kv; ++i) {
        gguf_blob_kv e;
        if (!r.read_str(e.key) || !r.read(e.type)) {
            return false;
        }
        if (e.type == GGUF_TYPE_ARRAY) {
            if (!r.read(e.elem_type) || !r.read(e.n) || e.n > MAX_ITEMS) {
                return false;
            }
            for (uint64_t j = 0; j < e.n; ++j) {
                if (!r.read_value(e.elem_type, e.value)) {
                    return false;
                }
            }
        } else if (!r.read_value(e.type, e.value)) {
            return false;
        }
        kv.push_back(std::move(e));
    }

    tensors.clear();
    std::vector<uint64_t> offsets;
    for (int64_t i = 0; i < n_tensors; ++i) {
        gguf_blob_tensor t;
        uint32_t n_dims;
        if (!r.read_str(t.name) || !r.read(n_dims) || n_dims > GGML_MAX_DIMS) {
            return false;
        }
        t.ne.resize(n_dims);
        for (auto & d : t.ne) {
            if (!r.read(d)) {
                return false;
            }
        }
        uint64_t offset;
        if (!r.read(t.type) || !r.read(offset)) {
            return false;
        }
        offsets.push_back(offset);
        tensors.push_back(std::move(t));
    }

    // the data of a tensor the file is too short for is kept as far as it goes
    const size_t align = alignment();
    const size_t start = (r.pos + align - 1) / align * align;
    for (size_t i = 0; i < tensors.size(); ++i) {
        const size_t nbytes = tensors[i].nbytes();
        if (nbytes == SIZE_MAX || start > size || offsets[i] > size - start) {
            continue;
        }
        const size_t from = start + offsets[i];
        tensors[i].data.assign(data + from, data + from + std::min(nbytes, size - from));
    }
    return true;
}

std::vector<uint8_t> gguf_blob::serialize(size_t max_size) const {
    const size_t align = alignment();
    writer w;
    const char magic[4] = { 'G', 'G', 'U', 'F' };
    w.write(magic);
    w.write(version);
    w.write<int64_t>(tensors.size());
    w.write<int64_t>(kv.size());
    for (const auto & e : kv) {
        w.write_str(e.key);
        w.write(e.type);
        if (e.type == GGUF_TYPE_ARRAY) {
            w.write(e.elem_type);
            w.write(e.n);
        }
        w.write_bytes(e.value);
    }

    // offsets as the GGUF parser expects them: each tensor right after the padded previous one
    uint64_t offset = 0;
    std::vector<size_t> sizes;
    for (const auto & t : tensors) {
        const size_t nbytes = t.nbytes();
        // a tensor the parser rejects anyway keeps whatever data it has
        sizes.push_back(nbytes == SIZE_MAX ? t.data.size() : nbytes);
        if (sizes.back() > max_size) {
            return {};
        }
        w.write_str(t.name);
        w.write<uint32_t>(t.ne.size());
        for (int64_t d : t.ne) {
            w.write(d);
        }
        w.write(t.type);
        w.write(offset);
        offset += (sizes.back() + align - 1) / align * align;
        if (offset > max_size) {
            return {};
        }
    }
    w.pad(align);
    if (w.buf.size() + offset > max_size) {
        return {};
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
        std::vector<uint8_t> data = tensors[i].data;
        data.resize(sizes[i], 0);
        w.write_bytes(data);
        w.pad(align);
    }
    return std::move(w.buf);
}
