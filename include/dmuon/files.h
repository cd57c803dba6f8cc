// files.h -- dmuon's atomic file writes, for a caller's own outputs (metrics, reports), and the
// clean-up of what interrupted writes leave behind. LibTorch-free (the env layer): checkpoints,
// safetensors and `dmuon plan --calibrate` write through the same code.
#pragma once

#include <string>

namespace dmuon {

// Writes `content` to `path` atomically: a temporary file beside it (".NAME.tmp-PID"), flushed to
// disk, renamed over `path` (never written through a link put at the temporary's name). A crash leaves
// the old file or the new one, never part of one. Throws std::runtime_error naming `who`, the path and
// the reason; nothing is replaced then.
void write_file_atomically(const std::string& path, const std::string& content,
                           const std::string& who = "write_file_atomically");

// Appends `content` to the existing file `path` (never through a symlink) and flushes it to disk: the
// rows of a log that write_file_atomically began, without rewriting what is there (a whole rewrite per
// log made a long run's logging quadratic). A crash may cut the last row: readers take only lines that
// end in a newline. Throws std::runtime_error naming `who`, the path and the reason.
void append_file_durably(const std::string& path, const std::string& content,
                         const std::string& who = "append_file_durably");

// Removes the temporary files that interrupted atomic writes of `path` left beside it (those whose
// process is gone; a live writer's are kept). Every atomic write of `path` does this first; a
// launcher that stopped its writers (SIGINT, SIGTERM, a failed rank) calls it for their outputs.
void remove_stale_temporaries(const std::string& path);

}  // namespace dmuon
