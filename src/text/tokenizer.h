/* Byte-level BPE tokenizer (GPT-2 style) as described by GGUF metadata,
 * with SmolLM2's pre-tokenizer; ChatML chat template. */
#ifndef STILL_TOKENIZER_H
#define STILL_TOKENIZER_H

#include "still.h"
#include "format/gguf.h"
#include <stddef.h>
#include <stdint.h>

typedef struct tokenizer tokenizer;

/* GGUF token types (tokenizer.ggml.token_type) */
enum { TOKEN_TYPE_NORMAL = 1, TOKEN_TYPE_UNKNOWN = 2, TOKEN_TYPE_CONTROL = 3,
       TOKEN_TYPE_USER_DEFINED = 4, TOKEN_TYPE_UNUSED = 5, TOKEN_TYPE_BYTE = 6 };

typedef struct {
    int32_t n_vocab;
    const char *const *tokens;  const size_t *token_lens;   /* n_vocab byte strings (byte-level encoded as in GGUF) */
    const int32_t *token_types;                              /* n_vocab, may be NULL (all normal) */
    int32_t n_merges;
    const char *const *merges;  const size_t *merge_lens;    /* "a b" strings, rank = index */
    const char *pre;                                         /* pre-tokenizer name, e.g. "smollm" or "gpt2" */
    int32_t bos_id, eos_id, unk_id, pad_id;                  /* -1 if absent */
} tokenizer_desc;

/* Build from a description (all data is copied). */
int tokenizer_create(const tokenizer_desc *d, tokenizer **out, still_err *err);
void tokenizer_free(tokenizer *t);

int32_t tokenizer_n_vocab(const tokenizer *t);
int32_t tokenizer_bos(const tokenizer *t);
int32_t tokenizer_eos(const tokenizer *t);
/* Token id of an exact token string (e.g. "<|im_end|>"), or -1. */
int32_t tokenizer_find(const tokenizer *t, const char *text);
/* Is this an end-of-generation token (eos, <|im_end|>, <|endoftext|>)? */
int tokenizer_is_eog(const tokenizer *t, int32_t id);

/* Encode text (any bytes; invalid UTF-8 is tokenized byte-wise so that decode
 * reproduces the input exactly). If parse_special, control/user-defined token
 * strings appearing in the text (e.g. "<|im_start|>") become their ids.
 * *ids is malloc'ed and owned by the caller.
 * Note: a byte with no single-byte token in the vocabulary is dropped (as HF
 * and llama.cpp do); SmolLM2 lacks 21 of them (0x04 0x06 0x13 0x14 0x16 0x1D
 * 0xC0 0xC1 0xF1 0xF2 0xF5-0xFF), so only input free of those round-trips. */
int tokenizer_encode(const tokenizer *t, const char *text, size_t len, int parse_special,
                     int32_t **ids, size_t *n_ids, still_err *err);

/* Bytes of one token (byte-level decoding applied). Returns length; writes up
 * to cap bytes. Control tokens decode to their text. */
size_t tokenizer_decode_token(const tokenizer *t, int32_t id, char *buf, size_t cap);
/* Decode a sequence into a malloc'ed buffer (NUL-terminated; *len excludes NUL). */
int tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len, still_err *err);

/* ChatML rendering: roles/contents arrays of n messages; if add_generation_prompt,
 * appends "<|im_start|>assistant\n". Adds SmolLM2's default system prompt when
 * the first message is not a system message and default_system != NULL.
 * Returns a malloc'ed NUL-terminated string. */
int chatml_render(const char *const *roles, const char *const *contents, size_t n,
                  int add_generation_prompt, const char *default_system,
                  char **out, still_err *err);

/* ---- additions ---------------------------------------------------------- */

/* SmolLM2's default system prompt (as in its GGUF chat template). */
#define SMOLLM2_DEFAULT_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

/* Build a tokenizer from the tokenizer.* metadata of a GGUF file:
 * tokenizer.ggml.model (must be "gpt2"), .pre, .tokens, .token_type,
 * .merges, .bos/eos/unknown/padding_token_id, tokenizer.chat_template.
 * Errors: STILL_E_FORMAT for missing/malformed keys, STILL_E_UNSUPPORTED for
 * another tokenizer model or pre-tokenizer. Nothing of f is referenced after
 * return. */
int tokenizer_from_gguf(const gguf_file *f, tokenizer **out, still_err *err);

/* Attach a (Jinja) chat template; the default system prompt is extracted from
 * it when it has the ChatML "<|im_start|>system\n...<|im_end|>" literal.
 * tmpl need not be NUL-terminated. Called by tokenizer_from_gguf. */
int tokenizer_set_chat_template(tokenizer *t, const char *tmpl, size_t len, still_err *err);
/* The attached chat template (NUL-terminated) or NULL. */
const char *tokenizer_chat_template(const tokenizer *t);
/* Default system prompt found in the chat template, or NULL if none. Pass it
 * as chatml_render's default_system. */
const char *tokenizer_default_system(const tokenizer *t);

/* Token type (TOKEN_TYPE_*) of id, or 0 if out of range. */
int32_t tokenizer_token_type(const tokenizer *t, int32_t id);
/* Raw token string as stored in the vocabulary (byte-level encoded, not
 * NUL-terminated), or NULL if out of range. */
const char *tokenizer_token_str(const tokenizer *t, int32_t id, size_t *len);

#endif
