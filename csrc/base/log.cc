#include "base/log.h"

#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <mutex>

namespace fxm {

bool log_enabled(LogLevel level) {
  return static_cast<int>(level) <= static_cast<int>(env_config().log_level);
}

namespace {

// "2026-12-05T14:07:01.123456Z": UTC, microseconds.
void format_now(char* out, size_t size) {
  timeval tv{};
  ::gettimeofday(&tv, nullptr);
  tm utc{};
  ::gmtime_r(&tv.tv_sec, &utc);
  char day[32];
  std::strftime(day, sizeof day, "%Y-%m-%dT%H:%M:%S", &utc);
  std::snprintf(out, size, "%s.%06ldZ", day, static_cast<long>(tv.tv_usec));
}

struct Capture {
  std::mutex mu;
  std::condition_variable cv;
  bool on = false;
  std::deque<CapturedLine> lines;
  uint64_t dropped = 0;
};

Capture& capture() {
  static Capture* c = new Capture();  // never destroyed: logging may happen during exit
  return *c;
}

// True when the line went to the capture queue.
bool captured(LogLevel level, const std::string& text) {
  Capture& c = capture();
  std::lock_guard<std::mutex> lock(c.mu);
  if (!c.on) return false;
  if (c.lines.size() >= kLogCaptureMax) {
    c.lines.pop_front();
    ++c.dropped;
  }
  c.lines.push_back({level, text});
  c.cv.notify_one();
  return true;
}

}  // namespace

void log_capture(bool on) {
  Capture& c = capture();
  std::lock_guard<std::mutex> lock(c.mu);
  c.on = on;
  c.cv.notify_all();
}

std::vector<CapturedLine> log_take(double timeout_s, size_t max, uint64_t* dropped) {
  Capture& c = capture();
  std::unique_lock<std::mutex> lock(c.mu);
  if (timeout_s > 0) {
    c.cv.wait_for(lock, std::chrono::duration<double>(std::min(timeout_s, 3600.0)),
                  [&] { return !c.lines.empty() || !c.on; });
  }
  std::vector<CapturedLine> out;
  while (!c.lines.empty() && out.size() < max) {
    out.push_back(std::move(c.lines.front()));
    c.lines.pop_front();
  }
  *dropped = c.dropped;
  c.dropped = 0;
  return out;
}

namespace {
thread_local std::string t_speaker;
}  // namespace

LogSpeaker::LogSpeaker(std::string who) : outer_(std::move(t_speaker)) { t_speaker = std::move(who); }
LogSpeaker::~LogSpeaker() { t_speaker = std::move(outer_); }

// "flagcx_mesh WARN 2026-12-05T14:07:01.123456Z pid 4711 [rank 3] message": one write per line.
void log_line(LogLevel level, int rank, const std::string& said) {
  static const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  bool spoken = !t_speaker.empty();
  const std::string& msg = spoken && said.compare(0, t_speaker.size(), t_speaker) != 0 ? t_speaker + said : said;
  if (spoken) rank = -1;
  const char* name = names[static_cast<int>(level)];
  char now[48];
  format_now(now, sizeof now);
  char where[32] = "";
  if (rank >= 0) std::snprintf(where, sizeof where, " [rank %d]", rank);
  if (captured(level, rank >= 0 ? std::string(where + 1) + " " + msg : msg)) return;
  std::fprintf(stderr, "flagcx_mesh %s %s pid %d%s %s\n", name, now, static_cast<int>(::getpid()), where, msg.c_str());
  std::fflush(stderr);
}

}  // namespace fxm
