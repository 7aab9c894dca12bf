// A small JSON reader (objects, arrays, strings, numbers, true/false/null), header-only: what serve.cpp reads an
// artifact's spec (extra/lightning_rec.json) with. Not a general-purpose parser: \u escapes outside ASCII are kept
// as written, numbers are read as double (exact for every integer a spec holds, up to 2^53).
#pragma once

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace lightning_rec {

struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool boolean = false;
  double number = 0;
  std::string text;
  std::vector<Json> items;
  std::map<std::string, Json> fields;

  // The member `key` of an object (a null value if absent).
  const Json& operator[](const std::string& key) const {
    static const Json none;
    const auto at = fields.find(key);
    return at == fields.end() ? none : at->second;
  }
  bool is_null() const { return kind == Null; }

  static Json parse(const std::string& source) {
    size_t at = 0;
    Json value = read(source, at);
    skip(source, at);
    if (at != source.size()) fail(source, at, "trailing characters");
    return value;
  }

 private:
  [[noreturn]] static void fail(const std::string& source, size_t at, const std::string& what) {
    throw std::runtime_error("spec is not valid JSON at character " + std::to_string(at) + ": " + what);
  }
  static void skip(const std::string& s, size_t& at) {
    while (at < s.size() && (s[at] == ' ' || s[at] == '\n' || s[at] == '\t' || s[at] == '\r')) ++at;
  }
  static std::string read_string(const std::string& s, size_t& at) {
    std::string out;
    for (++at; at < s.size() && s[at] != '"'; ++at) {
      if (s[at] != '\\') {
        out += s[at];
        continue;
      }
      if (++at >= s.size()) break;
      switch (s[at]) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          const unsigned code = std::stoul(s.substr(at + 1, 4), nullptr, 16);
          if (code < 0x80) {
            out += static_cast<char>(code);
          } else {
            out += "\\u" + s.substr(at + 1, 4);
          }
          at += 4;
          break;
        }
        default: out += s[at];
      }
    }
    if (at >= s.size()) fail(s, at, "unterminated string");
    ++at;
    return out;
  }
  static Json read(const std::string& s, size_t& at) {
    skip(s, at);
    if (at >= s.size()) fail(s, at, "unexpected end");
    Json value;
    const char c = s[at];
    if (c == '{') {
      value.kind = Object;
      ++at;
      skip(s, at);
      if (at < s.size() && s[at] == '}') return ++at, value;
      while (true) {
        skip(s, at);
        if (at >= s.size() || s[at] != '"') fail(s, at, "expected a key");
        std::string key = read_string(s, at);
        skip(s, at);
        if (at >= s.size() || s[at] != ':') fail(s, at, "expected ':'");
        ++at;
        value.fields[key] = read(s, at);
        skip(s, at);
        if (at < s.size() && s[at] == ',') {
          ++at;
          continue;
        }
        if (at < s.size() && s[at] == '}') return ++at, value;
        fail(s, at, "expected ',' or '}'");
      }
    }
    if (c == '[') {
      value.kind = Array;
      ++at;
      skip(s, at);
      if (at < s.size() && s[at] == ']') return ++at, value;
      while (true) {
        value.items.push_back(read(s, at));
        skip(s, at);
        if (at < s.size() && s[at] == ',') {
          ++at;
          continue;
        }
        if (at < s.size() && s[at] == ']') return ++at, value;
        fail(s, at, "expected ',' or ']'");
      }
    }
    if (c == '"') {
      value.kind = String;
      value.text = read_string(s, at);
      return value;
    }
    for (const char* word : {"true", "false", "null"}) {
      if (s.compare(at, std::string(word).size(), word) == 0) {
        at += std::string(word).size();
        value.kind = word[0] == 'n' ? Null : Bool;
        value.boolean = word[0] == 't';
        return value;
      }
    }
    size_t used = 0;
    try {
      value.number = std::stod(s.substr(at, 32), &used);
    } catch (const std::exception&) {
      fail(s, at, "unexpected character");
    }
    value.kind = Number;
    at += used;
    return value;
  }
};

}  // namespace lightning_rec
